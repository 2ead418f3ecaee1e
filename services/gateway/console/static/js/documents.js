// The Documents tab: the KB's documents with their per-KB status, uploads (picker or drag and
// drop, each file's progress and outcome), tags / collection editing and deletion.
import { api, query, upload } from "./api.js";
import { clear, h } from "./dom.js";
import { confirmDialog, docBadge, emptyState, errorBox, modal, nameSearch, num, pager, splitList, table, tagList, toast, when } from "./ui.js";

const PAGE = 20;

export function renderDocuments(panel, getKb, onChange) {
  const kbPath = () => encodeURIComponent(getKb().kb_id);
  const state = { skip: 0, search: "", status: "", page: null };
  const list = h("div.doc-list");
  const uploads = h("ul.uploads", { "aria-label": "Uploads" });
  const fileInput = h("input#upload-files.visually-hidden", {
    type: "file",
    multiple: true,
    onchange: () => {
      startUploads([...fileInput.files]);
      fileInput.value = "";
    },
  });
  const search = nameSearch("doc-search", state, () => {
    clearTimeout(debounce);
    debounce = setTimeout(load, 250);
  });
  let debounce = null;
  const statusFilter = h(
    "select#doc-status",
    {
      "aria-label": "Status",
      onchange: () => { state.status = statusFilter.value; state.skip = 0; load(); },
    },
    [["", "Any status"], ["complete", "Indexed"], ["processing", "Processing"],
      ["pending_reindex", "Pending reindex"], ["failed", "Failed"], ["awaiting_ocr", "Awaiting OCR"]]
      .map(([value, label]) => h("option", { value }, label)),
  );

  const drop = h(
    "div.dropzone",
    h("div.dropzone-text",
      h("strong", "Drop files here"),
      h("span.muted", " or "),
      h("label.btn.btn-primary.upload-label", { for: "upload-files" }, "Upload files")),
    h("p.help", "Text, Markdown, HTML, PDF with a text layer, DOCX; images wait for OCR. Up to 10 MB each."),
    fileInput,
  );
  for (const type of ["dragenter", "dragover"]) {
    drop.addEventListener(type, (e) => {
      e.preventDefault();
      drop.classList.add("dragging");
    });
  }
  drop.addEventListener("dragleave", () => drop.classList.remove("dragging"));
  drop.addEventListener("drop", (e) => {
    e.preventDefault();
    drop.classList.remove("dragging");
    startUploads([...e.dataTransfer.files]);
  });

  clear(panel).append(
    drop,
    uploads,
    h("div.toolbar", search, statusFilter),
    list,
  );

  function startUploads(files) {
    for (const file of files) uploadOne(file);
  }

  async function uploadOne(file) {
    const bar = h("progress", { max: "1", value: "0", "aria-label": `Upload of ${file.name}` });
    const status = h("span.upload-status", "Uploading…");
    const row = h("li.upload", h("span.upload-name", file.name), bar, status);
    uploads.prepend(row);
    const setStatus = (text, kind) => {
      status.textContent = text;
      row.dataset.state = kind;
    };
    try {
      // The file as it is, in a form: the server reads its type from its bytes and name.
      const form = new FormData();
      form.append("file", file, file.name);
      const result = await upload(`/v1/kbs/${kbPath()}/documents?wait=true`, form, (f) => {
        bar.value = f;
        if (f >= 1) setStatus("Indexing…", "indexing");
      });
      bar.value = 1;
      if (result.status === "complete") setStatus(`Indexed · ${num(result.chunk_count)} chunk${result.chunk_count === 1 ? "" : "s"}`, "ok");
      else if (result.status === "failed") setStatus(`Failed: ${result.error || "unknown reason"}`, "error");
      else if (result.status === "awaiting_ocr") setStatus("Awaiting OCR", "waiting");
      else if (result.status === "stored") setStatus("Stored (no knowledge base indexes it)", "waiting");
      else setStatus("Indexing…", "indexing");
    } catch (err) {
      setStatus(`Failed: ${err.message}`, "error");
    }
    load();
    onChange();
  }

  async function load() {
    if (stopped) return;
    const params = { skip: state.skip, limit: PAGE, name_search: state.search.trim(), status: state.status };
    let kbDocs;
    try {
      // The KB's list carries each document's status in this KB, its path, tags and reason.
      kbDocs = await api("GET", `/v1/kbs/${kbPath()}/documents${query(params)}`);
    } catch (err) {
      clear(list).append(errorBox(err));
      return;
    }
    if (stopped) return;
    state.page = kbDocs.items;
    draw(kbDocs.total);
    clearTimeout(timer);
    if (state.page.some((d) => d.status === "processing" || d.status === "pending_reindex")) {
      timer = setTimeout(load, 1500);
    }
  }
  let timer = null;
  let stopped = false;

  function draw(total) {
    clear(list);
    if (!total) {
      list.append(
        state.search || state.status
          ? emptyState("No matching documents", "No document matches the name or status asked for.")
          : emptyState("No documents yet", "Upload files above; they are chunked, embedded and searchable in seconds."),
      );
      return;
    }
    list.append(
      table(
        [
          {
            label: "Name",
            // Two files of one name from different folders differ by their path.
            cell: (d) => h("span.doc-name-cell", h("span.doc-name", d.name),
              d.uri && d.uri !== d.name ? h("span.doc-uri.muted", d.uri) : null),
            className: "col-name",
          },
          {
            label: "Status",
            cell: (d) => {
              const reason = d.status === "failed" && d.error;
              return h("span.status-cell", docBadge(d.status), reason ? h("span.reason", reason) : null);
            },
          },
          { label: "Chunks", cell: (d) => num(d.chunk_count), className: "num" },
          { label: "Indexed", cell: (d) => when(d.indexed_at), className: "nowrap" },
          { label: "Tags", cell: (d) => tagList(d.tags) },
          { label: "Collection", cell: (d) => d.collection || h("span.muted", "—") },
          {
            label: "Actions",
            className: "col-actions",
            cell: (d) => h("span.row-actions",
              h("button.btn.btn-small", { type: "button", onclick: () => editDoc(d), "aria-label": `Edit ${d.name}` }, "Edit"),
              h("button.btn.btn-small.btn-danger-ghost", { type: "button", onclick: () => deleteDoc(d), "aria-label": `Delete ${d.name}` }, "Delete")),
          },
        ],
        state.page,
        { caption: "Documents", rowAttrs: (d) => ({ "data-document": d.document_id }) },
      ),
      pager({ skip: state.skip, limit: PAGE, total, onPage: (skip) => { state.skip = skip; load(); } }),
    );
  }

  async function editDoc(d) {
    const detail = d.detail || (await api("GET", `/v1/documents/${encodeURIComponent(d.document_id)}`));
    const implicit = detail.tags.filter((t) => t.startsWith("kb:"));
    const tags = h("input#doc-tags", { type: "text", value: detail.tags.filter((t) => !t.startsWith("kb:")).join(", "), autocomplete: "off" });
    const collection = h("input#doc-collection", { type: "text", value: detail.collection || "", autocomplete: "off" });
    const saved = await modal({
      title: `Edit “${d.name}”`,
      confirm: "Save",
      body: h("div.form-grid.one",
        h("div.field", h("label", { for: "doc-tags" }, "Tags"), tags,
          h("p.help", "Comma-separated. Knowledge bases listing one of these tags include the document.")),
        h("div.field", h("label", { for: "doc-collection" }, "Collection"), collection,
          h("p.help", "At most one per document; empty removes it."))),
      onSubmit: () => {
        const value = collection.value.trim();
        return api("PATCH", `/v1/documents/${encodeURIComponent(d.document_id)}`, {
          tags: [...implicit, ...splitList(tags.value)],
          ...(value ? { collection: value } : { clear_collection: true }),
        });
      },
    });
    if (saved) {
      toast(`Saved “${d.name}”`);
      load();
    }
  }

  async function deleteDoc(d) {
    const done = await confirmDialog(
      `Delete “${d.name}”?`,
      "The document is deleted everywhere: from this and every other knowledge base, and from search results.",
      "Delete",
      () => api("DELETE", `/v1/documents/${encodeURIComponent(d.document_id)}`),
    );
    if (!done) return;
    toast(`Deleted “${d.name}”`);
    load();
    onChange();
  }

  load();
  return () => {
    stopped = true;
    clearTimeout(timer);
    clearTimeout(debounce);
  };
}
