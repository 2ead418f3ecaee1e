// One knowledge base: tabs Overview, Documents, Search, Sources, Settings (ARIA tabs, arrow keys).
import { all, api, ApiError, events } from "./api.js";
import { clear, h } from "./dom.js";
import { renderDocuments } from "./documents.js";
import { deleteKb, kbForm } from "./kbform.js";
import { renderSearch } from "./search.js";
import { renderSources } from "./sources.js";
import { ago, confirmDialog, errorBox, kbBadge, num, pageHeader, setView, tagList, toast, when } from "./ui.js";

const TABS = [
  ["overview", "Overview"],
  ["documents", "Documents"],
  ["search", "Search"],
  ["sources", "Sources"],
  ["settings", "Settings"],
];

export async function renderKb(main, kbId, tab = "overview") {
  let kb;
  try {
    kb = await api("GET", `/v1/kbs/${encodeURIComponent(kbId)}`);
  } catch (err) {
    setView(
      main,
      pageHeader(err instanceof ApiError && err.status === 404 ? "Knowledge base not found" : "Knowledge base", {
        crumbs: [h("a", { href: "#/kbs" }, "Knowledge bases")],
      }),
      errorBox(err),
    );
    return null;
  }
  document.title = `${kb.name} · kbmesh`;
  const base = `#/kbs/${encodeURIComponent(kb.kb_id)}`;
  const cleanups = [];
  const state = { kb, stats: null, reindex: null };

  const title = h("h1", kb.name);
  const badgeSlot = h("span.title-badge", kbBadge(kb.status));
  const desc = h("p.lead", kb.description || "");
  const tablist = h("div.tabs", { role: "tablist", "aria-label": "Knowledge base sections" });
  const panels = {};
  const tabs = {};
  const rendered = {};

  for (const [key, label] of TABS) {
    tabs[key] = h("button.tab", {
      type: "button",
      role: "tab",
      id: `tab-${key}`,
      "aria-controls": `panel-${key}`,
      "aria-selected": "false",
      tabindex: "-1",
      onclick: () => select(key),
      onkeydown: (e) => {
        const i = TABS.findIndex(([k]) => k === key);
        const step = { ArrowRight: 1, ArrowLeft: -1 }[e.key];
        if (step) {
          const next = TABS[(i + step + TABS.length) % TABS.length][0];
          select(next);
          tabs[next].focus();
        }
      },
    }, label);
    tablist.append(tabs[key]);
    panels[key] = h("section.panel", { role: "tabpanel", id: `panel-${key}`, "aria-labelledby": `tab-${key}`, hidden: true });
  }

  function select(key) {
    for (const [k] of TABS) {
      const on = k === key;
      tabs[k].setAttribute("aria-selected", on ? "true" : "false");
      tabs[k].tabIndex = on ? 0 : -1;
      panels[k].hidden = !on;
    }
    history.replaceState(null, "", `${base}/${key}`);
    if (!rendered[key] || key === "settings") {
      rendered[key] = true;
      const render = { overview: drawOverview, documents: drawDocuments, search: drawSearch, sources: drawSources, settings: drawSettings }[key];
      render();
    }
  }

  setView(
    main,
    h(
      "div.page-header",
      h("nav.crumbs", { "aria-label": "Breadcrumb" }, h("a", { href: "#/kbs" }, "Knowledge bases"), h("span", kb.name)),
      h("div.page-title-row", h("div.title-group", title, badgeSlot)),
      desc,
    ),
    tablist,
    Object.values(panels),
  );

  // ---- Overview ---------------------------------------------------------------------------
  const overview = {
    stats: h("div.stats"),
    progress: h("div.progress-box", { role: "status", "aria-live": "polite", hidden: true }),
    config: h("dl.config"),
  };

  function drawOverview() {
    const p = clear(panels.overview);
    p.append(
      h(
        "div.actions.overview-actions",
        h("button.btn", { type: "button", onclick: reindexAll }, "Reindex"),
        h("button.btn", { type: "button", id: "retry-failed", onclick: retryFailed }, "Retry failed"),
        h("button.btn", { type: "button", onclick: () => { select("settings"); tabs.settings.focus(); } }, "Edit"),
        h("button.btn.btn-danger", { type: "button", onclick: () => deleteKb(state.kb, { before: pause, failed: resume }) }, "Delete"),
      ),
      overview.progress,
      h("h2.section-title", "Statistics"),
      overview.stats,
      h("h2.section-title", "Configuration"),
      h("div.card", overview.config),
    );
    paintOverview();
  }

  function stat(label, value, hint, small = false) {
    return h("div.stat", h(small ? "div.stat-value.small" : "div.stat-value", value), h("div.stat-label", label), hint ? h("div.stat-hint", hint) : null);
  }

  function paintOverview() {
    const { kb: k, stats: s } = state;
    const docs = s ? s.document_count : k.document_count;
    const chunks = s ? s.chunk_count : k.chunk_count;
    clear(overview.stats).append(
      stat("Documents", num(docs), s && s.total_documents_with_tags !== docs ? `${num(s.total_documents_with_tags)} matching` : null),
      stat("Chunks", num(chunks)),
      stat("Avg chunks / document", docs ? (chunks / docs).toFixed(1) : "—"),
      stat("Failed", s ? num(s.failed_count) : "—"),
      stat("Last indexed", ago(state.lastIndexed), state.lastIndexed ? when(state.lastIndexed) : null),
    );
    const retry = panels.overview.querySelector("#retry-failed");
    if (retry) retry.disabled = !s || s.failed_count === 0;
    const rows = [
      ["Status", kbBadge(k.status)],
      ["Chunker", k.chunker],
      ["Chunk size", `${num(k.chunk_size)} tokens`],
      ["Chunk overlap", `${num(k.chunk_overlap)} tokens`],
      ["Embedding model", h("code", k.embedding_model)],
      ["Coalesce neighbors", String(k.coalesce_neighbors)],
      ["Tags", tagList(k.tag_ids)],
      ["Settings version", String(k.settings_version)],
      ["Created", when(k.created_at)],
      ["Updated", when(k.updated_at)],
      ["ID", h("code", k.kb_id)],
    ];
    clear(overview.config).append(...rows.flatMap(([dt, dd]) => [h("dt", dt), h("dd", dd)]));
    paintProgress();
  }

  /** What to show in the progress box: the stats' `progress` where the server reports it
   * (a reindex, or documents still pending), else the documents pending at the current
   * settings version. */
  function progressOf() {
    const s = state.stats;
    if (!s) return null;
    if (s.progress) {
      const r = s.progress.reindex;
      const ours = state.reindex && r && r.settings_version >= state.reindex;
      if (r && (r.done < r.total || ours)) return { reindex: true, done: r.done, total: r.total };
      if (s.progress.pending > 0) {
        return { reindex: false, done: s.progress.indexed, total: s.progress.total - s.progress.failed };
      }
      return null;
    }
    const total = Math.max(0, s.total_documents_with_tags - s.failed_count);
    return { reindex: Boolean(state.reindex), done: Math.max(0, total - s.pending_count), total };
  }

  function paintProgress() {
    const box = overview.progress;
    const busy = state.kb.status === "pending_reindex" || state.kb.status === "indexing";
    const p = progressOf();
    if (!p || (!busy && !p.reindex && !state.stats.progress)) {
      box.hidden = true;
      return;
    }
    const finished = !busy && p.done >= p.total;
    const verb = p.reindex ? "Reindexing" : "Indexing";
    // Servers that report progress can also abandon a running reindex.
    const cancel = p.reindex && !finished && state.stats.progress
      ? h("button.btn.btn-small", { type: "button", onclick: cancelReindex }, "Cancel reindex")
      : null;
    clear(box).append(
      h("div.progress-head",
        h("strong", finished ? (p.reindex ? "Reindex complete" : "Indexing complete") : `${verb}…`),
        h("span.progress-side", h("span.progress-count", `${num(p.done)} of ${num(p.total)} documents`), cancel)),
      h("progress", { max: String(Math.max(p.total, 1)), value: String(finished && !p.total ? 1 : p.done), "aria-label": `${verb} progress` }),
    );
    box.classList.toggle("done", finished);
    box.hidden = false;
  }

  async function reindexAll() {
    const n = state.stats ? state.stats.total_documents_with_tags : state.kb.document_count;
    const ok = await confirmDialog(
      "Reindex this knowledge base?",
      `All ${n} document${n === 1 ? "" : "s"} are chunked and embedded again. Searches keep answering meanwhile.`,
      "Reindex",
      () => api("POST", `/v1/kbs/${encodeURIComponent(state.kb.kb_id)}/reindex`),
    );
    if (!ok) return;
    state.reindex = state.kb.settings_version + 1;
    toast("Reindex started");
    refresh();
  }

  async function cancelReindex() {
    const ok = await confirmDialog(
      "Cancel the reindex?",
      "The half-built index is dropped and the knowledge base returns to the settings of the index that answers searches now.",
      "Cancel reindex",
      () => api("POST", `/v1/kbs/${encodeURIComponent(state.kb.kb_id)}/reindex/cancel`),
      "Keep reindexing",
    );
    if (!ok) return;
    state.reindex = null;
    toast("Reindex cancelled");
    refresh();
  }

  async function retryFailed() {
    try {
      const ack = await api("POST", `/v1/kbs/${encodeURIComponent(state.kb.kb_id)}/retry-failed`);
      toast(`Retrying failed documents (${ack.documents ?? 0} in this knowledge base)`);
      refresh();
    } catch (err) {
      toast(err.message, "error");
    }
  }

  // ---- live refresh -----------------------------------------------------------------------
  let timer = null;
  let stopped = false;
  let lastDocs = -1;
  let inflight = null;
  let again = false;
  // One refresh at a time (timer, events and uploads all ask): a request while one runs
  // makes exactly one more run after it, so there is only ever one timer.
  function refresh() {
    if (stopped) return Promise.resolve();
    if (inflight) {
      again = true;
      return inflight;
    }
    inflight = load().finally(() => {
      inflight = null;
      if (again && !stopped) {
        again = false;
        refresh();
      }
    });
    return inflight;
  }

  /** Before the KB is deleted: no request of this page may race the DELETE (and 404). */
  async function pause() {
    stopped = true;
    clearTimeout(timer);
    clearTimeout(soon);
    if (stream) stream.close();
    stream = null;
    live = false;
    if (stopDocuments) stopDocuments();
    if (inflight) await inflight.catch(() => {});
  }

  function resume() {
    stopped = false;
    refresh();
  }

  async function load() {
    clearTimeout(timer);
    try {
      const [k, s] = await Promise.all([
        api("GET", `/v1/kbs/${encodeURIComponent(kbId)}`),
        api("GET", `/v1/kbs/${encodeURIComponent(kbId)}/stats`),
      ]);
      state.kb = k;
      state.stats = s;
      if (s.document_count !== lastDocs || !state.lastIndexed) {
        lastDocs = s.document_count;
        const docs = await all(`/v1/kbs/${encodeURIComponent(kbId)}/documents`);
        state.lastIndexed = docs.map((d) => d.indexed_at).filter(Boolean).sort().pop() || null;
      }
    } catch (err) {
      if (err instanceof ApiError && err.status === 404) return; // deleted meanwhile
    }
    if (stopped) return;
    title.textContent = state.kb.name;
    clear(badgeSlot).append(kbBadge(state.kb.status));
    desc.textContent = state.kb.description || "";
    if (rendered.overview) paintOverview();
    if (state.stats && state.stats.progress && !stream) listen();
    const busy = ["pending_reindex", "indexing"].includes(state.kb.status) || (state.stats && state.stats.pending_count > 0);
    // With the event stream, events trigger refreshes and polling is only a safety net.
    timer = setTimeout(refresh, live ? 10000 : busy ? 1000 : 5000);
  }

  // A server that reports `progress` in stats also streams it: refresh on each event.
  let stream = null;
  let live = false;
  let soon = null;
  function listen() {
    stream = events(`/v1/kbs/${encodeURIComponent(kbId)}/events`, (type) => {
      if (type === "closed") {
        live = false;
        return;
      }
      live = true;
      if (type === "deleted") return;
      clearTimeout(soon);
      soon = setTimeout(refresh, 150);
    });
    stream.opened.then((ok) => { live = ok; });
  }
  cleanups.push(() => {
    stopped = true;
    clearTimeout(timer);
    clearTimeout(soon);
    if (stream) stream.close();
  });

  // ---- the other tabs ---------------------------------------------------------------------
  let stopDocuments = null;
  function drawDocuments() {
    stopDocuments = renderDocuments(panels.documents, () => state.kb, refresh);
    cleanups.push(stopDocuments);
  }

  function drawSearch() {
    renderSearch(panels.search, () => state.kb);
  }

  function drawSources() {
    cleanups.push(renderSources(panels.sources, () => state.kb));
  }

  function drawSettings() {
    const p = clear(panels.settings);
    p.append(
      h("div.card", kbForm({
        kb: state.kb,
        pause,
        resume,
        documents: state.stats ? state.stats.total_documents_with_tags : null,
        onSaved: (saved) => {
          const reindexing = saved.settings_version !== state.kb.settings_version;
          state.kb = saved;
          toast(reindexing ? "Saved: reindexing started" : "Saved");
          if (reindexing) {
            state.reindex = saved.settings_version;
            state.stats = null;
            select("overview");
            tabs.overview.focus();
          } else {
            drawSettings();
          }
          refresh();
        },
      })),
    );
  }

  select(TABS.some(([k]) => k === tab) ? tab : "overview");
  await refresh();
  return () => cleanups.forEach((fn) => fn && fn());
}
