// Knowledge bases: one table with search by name, a status filter, sorting and pages.
import { all } from "./api.js";
import { clear, h } from "./dom.js";
import { emptyState, errorBox, KB_STATUSES, kbBadge, nameSearch, num, pageHeader, pager, setView, table, tagList, when } from "./ui.js";

const PAGE = 20;
const SORTS = {
  name: (a, b) => a.name.localeCompare(b.name),
  documents: (a, b) => a.document_count - b.document_count,
  chunks: (a, b) => a.chunk_count - b.chunk_count,
  created: (a, b) => a.created_at.localeCompare(b.created_at),
};
const SORT_LABELS = { name: "Name", documents: "Documents", chunks: "Chunks", created: "Created" };

export async function renderKbList(main) {
  const state = { search: "", status: "", sort: "created", dir: "desc", skip: 0, items: null };
  const results = h("div.results");
  const newButton = h("a.btn.btn-primary", { href: "#/kbs/new" }, "New knowledge base");
  const search = nameSearch("kb-search", state, () => draw());
  const status = h(
    "select#kb-status",
    { onchange: () => { state.status = status.value; state.skip = 0; draw(); } },
    h("option", { value: "" }, "All statuses"),
    KB_STATUSES.map((s) => h("option", { value: s.value }, s.label)),
  );
  const sort = h(
    "select#kb-sort",
    { onchange: () => { [state.sort, state.dir] = sort.value.split(":"); draw(); } },
    Object.entries(SORT_LABELS).flatMap(([key, label]) => [
      h("option", { value: `${key}:asc`, selected: false }, `${label} ↑`),
      h("option", { value: `${key}:desc` }, `${label} ↓`),
    ]),
  );
  sort.value = "created:desc";

  setView(
    main,
    pageHeader("Knowledge bases", {
      actions: newButton,
      sub: h("p.lead", "Each knowledge base chunks and embeds the documents it holds with its own settings."),
    }),
    h(
      "div.toolbar",
      search,
      h("div.field-inline", h("label", { for: "kb-status" }, "Status"), status),
      h("div.field-inline", h("label", { for: "kb-sort" }, "Sort by"), sort),
    ),
    results,
  );

  function sortBy(key) {
    if (state.sort === key) state.dir = state.dir === "asc" ? "desc" : "asc";
    else [state.sort, state.dir] = [key, key === "name" ? "asc" : "desc"];
    sort.value = `${state.sort}:${state.dir}`;
    draw();
  }

  function head(key) {
    const active = state.sort === key;
    return h(
      "button.sort",
      {
        type: "button",
        onclick: () => sortBy(key),
        "aria-label": `Sort by ${SORT_LABELS[key].toLowerCase()}`,
        "aria-pressed": active ? "true" : "false",
      },
      SORT_LABELS[key],
      h("span.sort-arrow", { "aria-hidden": "true" }, active ? (state.dir === "asc" ? " ↑" : " ↓") : ""),
    );
  }

  function draw() {
    clear(results);
    if (state.items === null) return;
    if (!state.items.length) {
      results.append(
        emptyState(
          "No knowledge bases yet",
          "Create one to start uploading documents and searching them.",
          h("a.btn.btn-primary", { href: "#/kbs/new" }, "New knowledge base"),
        ),
      );
      return;
    }
    const needle = state.search.trim().toLowerCase();
    let rows = state.items.filter(
      (kb) => (!needle || kb.name.toLowerCase().includes(needle)) && (!state.status || kb.status === state.status),
    );
    rows.sort(SORTS[state.sort]);
    if (state.dir === "desc") rows.reverse();
    const total = rows.length;
    if (!total) {
      results.append(emptyState("No matching knowledge bases", "Change the name search or the status filter."));
      return;
    }
    rows = rows.slice(state.skip, state.skip + PAGE);
    results.append(
      table(
        [
          { label: "Name", head: head("name"), cell: (kb) => h("a.strong", { href: `#/kbs/${encodeURIComponent(kb.kb_id)}` }, kb.name), className: "col-name" },
          { label: "Description", cell: (kb) => kb.description ? h("span.clamp", kb.description) : h("span.muted", "—"), className: "col-desc" },
          { label: "Tags", cell: (kb) => tagList(kb.tag_ids) },
          { label: "Status", cell: (kb) => kbBadge(kb.status) },
          { label: "Documents", head: head("documents"), cell: (kb) => num(kb.document_count), className: "num" },
          { label: "Chunks", head: head("chunks"), cell: (kb) => num(kb.chunk_count), className: "num" },
          { label: "Embedding model", cell: (kb) => h("code.model", kb.embedding_model) },
          { label: "Created", head: head("created"), cell: (kb) => when(kb.created_at), className: "nowrap" },
        ],
        rows,
        { caption: "Knowledge bases", rowAttrs: (kb) => ({ "data-kb": kb.kb_id }) },
      ),
      pager({ skip: state.skip, limit: PAGE, total, onPage: (skip) => { state.skip = skip; draw(); } }),
    );
  }

  let timer = null;
  let stopped = false;
  async function load() {
    try {
      state.items = await all("/v1/kbs");
      draw();
    } catch (err) {
      clear(results).append(errorBox(err));
      return;
    }
    // Statuses change while documents are indexed: refresh until every KB is settled.
    if (!stopped && state.items.some((kb) => kb.status === "indexing" || kb.status === "pending_reindex")) {
      timer = setTimeout(load, 2000);
    }
  }
  await load();
  return () => {
    stopped = true;
    clearTimeout(timer);
  };
}
