// The Search tab: try a query against this KB with every option the search API has.
import { all, api } from "./api.js";
import { clear, h, highlighted } from "./dom.js";
import { emptyState, errorBox, splitList, tagList } from "./ui.js";

// What a hit's score means, by the response's `score_kind`.
const SCORE_KINDS = {
  fused: "rank fusion of the mode's signals (1.0 = first in every one)",
  rerank: "the rerank model's relevance",
};

function field(id, label, input, help) {
  input.id = id;
  return h("div.field", h("label", { for: id }, label), input, help ? h("p.help", help) : null);
}

export function renderSearch(panel, getKb) {
  const q = h("input", { type: "search", required: true, autocomplete: "off", placeholder: "Ask or type keywords", name: "query" });
  const topK = h("input", { type: "number", min: 1, max: 50, value: "5", inputmode: "numeric" });
  const mode = h("select", ["hybrid", "dense", "keyword"].map((m) => h("option", { value: m }, m)));
  const coalesce = h("input", { type: "number", min: 0, max: 5, inputmode: "numeric", placeholder: `KB default (${getKb().coalesce_neighbors})` });
  const docs = h("select", { multiple: true, size: 4 });
  const tags = h("input", { type: "text", autocomplete: "off", placeholder: "any of, comma-separated" });
  const name = h("input", { type: "text", autocomplete: "off", placeholder: "contains" });
  const collection = h("input", { type: "text", autocomplete: "off", placeholder: "exactly this one" });
  const sources = h("input", { type: "text", autocomplete: "off", placeholder: "any of, comma-separated" });
  const from = h("input", { type: "date" });
  const to = h("input", { type: "date" });
  const metaRows = h("div.meta-rows");
  const results = h("div.results", { "aria-live": "polite" });
  const submit = h("button.btn.btn-primary", { type: "submit" }, "Search");

  function addMetaRow() {
    const n = metaRows.children.length + 1;
    const key = h("input", { type: "text", autocomplete: "off", placeholder: "key", "aria-label": `Metadata key ${n}` });
    const value = h("input", { type: "text", autocomplete: "off", placeholder: "value (a, b = any of)", "aria-label": `Metadata value ${n}` });
    const row = h("div.meta-row", key, value,
      h("button.btn.btn-small.btn-ghost", { type: "button", "aria-label": `Remove metadata condition ${n}`, onclick: () => row.remove() }, "Remove"));
    metaRows.append(row);
  }

  let docsLoaded = false;
  const filters = h(
    "details.filters",
    {
      ontoggle: async () => {
        if (docsLoaded) return;
        docsLoaded = true;
        const items = await all(`/v1/kbs/${encodeURIComponent(getKb().kb_id)}/documents`).catch(() => []);
        docs.append(...items.map((d) => h("option", { value: d.document_id }, d.name)));
      },
    },
    h("summary", "Filters"),
    h("div.form-grid",
      field("sf-docs", "Documents", docs, "Only these documents (Ctrl/⌘-click for several)."),
      h("div",
        field("sf-name", "Document name", name),
        field("sf-tags", "Tags", tags)),
      h("div",
        field("sf-collection", "Collection", collection),
        field("sf-sources", "Sources", sources, "Source ids, e.g. a repository's.")),
      field("sf-from", "Uploaded from", from),
      field("sf-to", "Uploaded to", to),
      h("div.field.span-2",
        h("span.label", "Metadata"),
        metaRows,
        h("button.btn.btn-small", { type: "button", onclick: addMetaRow }, "Add condition"),
        h("p.help", "Each condition on a custom metadata key; a comma-separated value matches any of them."))),
  );

  function buildFilters() {
    const f = {};
    const ids = [...docs.selectedOptions].map((o) => o.value);
    if (ids.length) f.document_ids = ids;
    const t = splitList(tags.value);
    if (t.length) f.tags = t;
    if (name.value.trim()) f.document_name = name.value.trim();
    if (collection.value.trim()) f.collection = collection.value.trim();
    const s = splitList(sources.value);
    if (s.length) f.source_ids = s;
    if (from.value) f.upload_date_from = from.value;
    if (to.value) f.upload_date_to = to.value;
    const meta = [];
    for (const row of metaRows.children) {
      const [k, v] = row.querySelectorAll("input");
      if (!k.value.trim()) continue;
      const values = splitList(v.value).map((x) => (/^-?\d+$/.test(x) ? Number(x) : x));
      meta.push(values.length > 1 ? { key: k.value.trim(), any_of: values } : { key: k.value.trim(), eq: values[0] ?? "" });
    }
    if (meta.length) f.metadata = meta;
    return Object.keys(f).length ? f : null;
  }

  const form = h(
    "form.search-form",
    {
      novalidate: true,
      onsubmit: async (e) => {
        e.preventDefault();
        if (!q.value.trim()) {
          q.focus();
          return;
        }
        const body = { query: q.value, kb_ids: [getKb().kb_id], top_k: Number(topK.value || 5), mode: mode.value };
        if (coalesce.value !== "") body.coalesce_neighbors = Number(coalesce.value);
        const f = buildFilters();
        if (f) body.filters = f;
        submit.disabled = true;
        clearFieldErrors();
        clear(results).append(h("p.muted", "Searching…"));
        try {
          showResults(await api("POST", "/v1/search", body), q.value);
        } catch (err) {
          // An error that names one of the fields above is shown at that field.
          if (showFieldErrors(err)) clear(results);
          else clear(results).append(errorBox(err));
        } finally {
          submit.disabled = false;
        }
      },
    },
    h("div.search-main",
      field("sf-query", "Query", q),
      h("div.search-button", submit)),
    h("div.search-options",
      field("sf-topk", "Top k", topK),
      field("sf-mode", "Mode", mode),
      field("sf-coalesce", "Neighbours", coalesce)),
    filters,
  );

  const atField = { query: q, top_k: topK, mode, coalesce_neighbors: coalesce };
  function clearFieldErrors() {
    for (const input of Object.values(atField)) {
      input.removeAttribute("aria-invalid");
      input.parentElement.querySelector(".field-error")?.remove();
    }
  }
  function showFieldErrors(err) {
    const byField = err.fieldErrors ? err.fieldErrors() : {};
    let first = null;
    for (const [name, message] of Object.entries(byField)) {
      const input = atField[name];
      if (!input) continue;
      const note = h("p.field-error", { id: `${input.id}-error`, role: "alert" }, message);
      input.setAttribute("aria-invalid", "true");
      input.setAttribute("aria-describedby", note.id);
      input.parentElement.append(note);
      first ??= input;
    }
    first?.focus();
    return first !== null;
  }

  function showResults(answer, text) {
    clear(results);
    const matched = answer.hits.filter((hit) => hit.is_matched);
    if (!matched.length) {
      results.append(emptyState("No results", "Try other words, another mode, or fewer filters."));
      return;
    }
    const scoreKind = SCORE_KINDS[answer.score_kind] || answer.score_kind;
    results.append(h("p.result-summary.muted",
      `${matched.length} match${matched.length === 1 ? "" : "es"} · ${answer.mode} · score: ${scoreKind}`
      + (answer.coalesced ? ` · ${answer.coalesced} neighbour${answer.coalesced === 1 ? "" : "s"} each side` : "")));
    // The API returns each document's chunks together, in chunk order, when neighbours are
    // added: one card per run of the same document, neighbours set apart from matches.
    const groups = [];
    for (const hit of answer.hits) {
      const last = groups[groups.length - 1];
      if (last && last.key === `${hit.kb_id}/${hit.document_id}`) last.chunks.push(hit);
      else groups.push({ key: `${hit.kb_id}/${hit.document_id}`, chunks: [hit] });
    }
    const ol = h("ol.hits");
    for (const { chunks } of groups) {
      const first = chunks[0];
      const tags = (first.tags || []).filter((t) => !t.startsWith("kb:"));
      ol.append(
        h("li.hit",
          h("div.hit-head", h("span.hit-doc", first.document_name), tags.length ? tagList(tags) : null),
          chunks.map((c) => c.is_matched
            ? h("div.chunk.matched",
              h("div.chunk-meta",
                c.score !== null && c.score !== undefined ? h("span.score", `score ${c.score.toFixed(3)}`) : null,
                h("span", `chunk ${c.chunk_index + 1} of ${c.total_chunks}`),
                place(c) ? h("span.place", place(c)) : null,
                c.match_type ? h("span.match-type", c.match_type) : null),
              h("p", highlighted(c.content, text)))
            : h("div.chunk.neighbour",
              h("div.chunk-meta", h("span.neighbour-label", "neighbour"), h("span", `chunk ${c.chunk_index + 1} of ${c.total_chunks}`)),
              h("p", c.content)))),
      );
    }
    results.append(ol);
  }

  clear(panel).append(h("div.card", form), results);
}

// Where a chunk lies in its document: "Setup › Cooling · page 2" (as the MCP tools say it).
function place(hit) {
  const parts = (hit.heading_path || []).length ? [hit.heading_path.join(" › ")] : [];
  for (const [unit, numbers] of [["page", hit.pages || []], ["slide", hit.slides || []]]) {
    if (numbers.length === 1) parts.push(`${unit} ${numbers[0]}`);
    else if (numbers.length > 1) parts.push(`${unit}s ${numbers[0]}-${numbers[numbers.length - 1]}`);
  }
  return parts.join(" · ");
}
