// The Sources tab: the git repositories and web sites this KB is kept in sync with — each
// one's last run (status, counts, error), its next run, and "Sync now". Sources are added
// with `kbmesh sources add`, `kbmesh sources apply`, POST /v1/sources or kb_source_add.
import { api, ApiError } from "./api.js";
import { clear, h } from "./dom.js";
import { ago, emptyState, errorBox, num, table, toast, when } from "./ui.js";

const RUN_STATUS = {
  succeeded: ["Succeeded", "green"],
  running: ["Running", "yellow"],
  failed: ["Failed", "red"],
};
const COUNTS = ["added", "changed", "unchanged", "deleted", "failed"];

function runBadge(run) {
  if (!run) return h("span.badge.badge-grey", "Never run");
  const [label, color] = RUN_STATUS[run.status] || [String(run.status), "grey"];
  return h(`span.badge.badge-${color}`, label);
}

function counts(run) {
  if (!run) return h("span.muted", "—");
  return h(
    "span.source-counts",
    COUNTS.map((k) => h(`span.source-count.count-${k}`, { title: k }, `${num(run[k])} ${k}`)),
  );
}

export function renderSources(panel, getKb) {
  const list = h("div.source-list", { "aria-live": "polite" });
  const requested = new Set();
  let timer = null;
  let stopped = false;

  clear(panel).append(
    h("p.help",
      "Git repositories and web sites kept in sync with this knowledge base, on their schedule and on push. ",
      "Add one with ", h("code", "kbmesh sources add"), " or ", h("code", "kbmesh sources apply"), "."),
    list,
  );

  async function syncNow(source, button) {
    button.disabled = true;
    try {
      await api("POST", `/v1/sources/${encodeURIComponent(source.source_id)}/sync`);
      requested.add(source.source_id);
      toast(`Sync of ${source.name || source.url} requested`);
      load();
    } catch (err) {
      toast(err.message, "error");
      button.disabled = false;
    }
  }

  function draw(sources) {
    if (!sources.length) {
      clear(list).append(emptyState("No sources", "This knowledge base is fed by uploads only."));
      return;
    }
    const columns = [
      {
        label: "Source",
        cell: (s) => h("div.source-name",
          h("strong", s.name || s.url),
          h("div.muted.small", h("span.badge.badge-grey", s.kind), " ", h("code", s.url), s.branch ? ` @ ${s.branch}` : "")),
      },
      {
        label: "Last run",
        cell: (s) => {
          const run = s.status.last_run;
          return h("div", runBadge(run), run ? h("div.muted.small", ago(run.finished_at || run.started_at)) : null);
        },
      },
      { label: "Counts", cell: (s) => counts(s.status.last_run) },
      {
        label: "Next run",
        cell: (s) => (s.enabled ? (s.status.next_run_at ? when(s.status.next_run_at) : "—") : h("span.muted", "Paused")),
      },
      {
        label: "Error",
        className: "source-error",
        cell: (s) => {
          const error = s.status.last_run && s.status.last_run.error;
          return error ? h("span.error-text", error) : h("span.muted", "—");
        },
      },
      {
        label: "",
        head: h("span.visually-hidden", "Actions"),
        cell: (s) => {
          const pending = requested.has(s.source_id) || s.status.requested;
          const button = h("button.btn.btn-small", {
            type: "button",
            "aria-label": `Sync ${s.name || s.url} now`,
            onclick: () => syncNow(s, button),
          }, pending ? "Sync requested" : "Sync now");
          return button;
        },
      },
    ];
    clear(list).append(table(columns, sources, {
      caption: "Sources of this knowledge base",
      rowAttrs: (s) => ({ "data-source": s.source_id }),
    }));
  }

  async function load() {
    clearTimeout(timer);
    if (stopped) return;
    try {
      const page = await api("GET", `/v1/sources?kb=${encodeURIComponent(getKb().kb_id)}`);
      if (stopped) return;
      // A run that started since the request was made is no longer "requested".
      for (const s of page.items) {
        if (s.status.last_run && s.status.last_run.status === "running") requested.delete(s.source_id);
      }
      draw(page.items);
    } catch (err) {
      if (err instanceof ApiError && err.status === 404) return;
      clear(list).append(errorBox(err));
    }
    // Runs report into the sources' state: look again while the tab is open.
    timer = setTimeout(load, 5000);
  }

  load();
  return () => {
    stopped = true;
    clearTimeout(timer);
  };
}
