// The knowledge-base form: create, and edit (the Settings tab). Validation is the server's:
// its problem body names the field, and the message is shown next to that field.
import { api } from "./api.js";
import { h, nextId } from "./dom.js";
import { confirmDialog, pageHeader, setView, splitList, toast } from "./ui.js";

// The server's defaults and limits (GET /v1/defaults), read once: the form keeps no copy
// that could drift from what the server accepts.
let serverDefaults = null;
async function defaults() {
  serverDefaults ??= await api("GET", "/v1/defaults");
  return serverDefaults;
}
// Changing any of these re-chunks or re-embeds every document (the server's REINDEX_FIELDS).
const REINDEX = ["chunker", "chunk_size", "chunk_overlap", "embedding_model"];

const FIELDS = [
  { name: "name", label: "Name", type: "text", required: true, maxlength: 100,
    help: "Unique in your organisation; agents and the API may refer to the knowledge base by it." },
  { name: "description", label: "Description", type: "textarea", maxlength: 2000,
    help: "What the knowledge base holds. Agents read it to decide where to search." },
  { name: "tag_ids", label: "Tags", type: "list",
    help: "Comma-separated. Documents carrying any of these tags belong here, besides those uploaded into it." },
  { name: "chunker", label: "Chunker", type: "select", options: ["recursive", "sentence", "token"],
    help: "recursive splits on headings, paragraphs, then sentences; sentence keeps whole sentences; token cuts at fixed token counts." },
  { name: "chunk_size", label: "Chunk size", type: "number", step: 1,
    help: "Tokens per chunk, no more than the embedding model takes in one input." },
  { name: "chunk_overlap", label: "Chunk overlap", type: "number", min: 0, step: 1,
    help: "Tokens shared by neighbouring chunks; smaller than the chunk size." },
  { name: "embedding_model", label: "Embedding model", type: "text",
    help: "The bundled local model runs with no key; any LiteLLM model id (e.g. openai/text-embedding-3-small) for hosted providers." },
  { name: "coalesce_neighbors", label: "Coalesce neighbors", type: "number", min: 0, step: 1,
    help: "Chunks added on each side of every match in search results, for context." },
];

export async function renderKbNew(main) {
  const server = await defaults();
  setView(
    main,
    pageHeader("New knowledge base", {
      crumbs: [h("a", { href: "#/kbs" }, "Knowledge bases"), h("span", "New")],
    }),
    h("div.card", kbForm({
      server,
      onSaved: (kb) => {
        toast(`Knowledge base “${kb.name}” created`);
        location.hash = `#/kbs/${encodeURIComponent(kb.kb_id)}`;
      },
    })),
  );
}

function control(field, value, onInput, server) {
  const id = `kb-${field.name}`;
  const common = { id, name: field.name, "aria-describedby": `${id}-help ${id}-error`, oninput: onInput, onchange: onInput };
  if (field.type === "textarea") return h("textarea", { ...common, rows: 3, maxlength: field.maxlength, value: value ?? "" });
  if (field.type === "select") {
    const el = h("select", common, field.options.map((o) => h("option", { value: o }, o)));
    el.value = value ?? field.options[0];
    return el;
  }
  return h("input", {
    ...common,
    type: field.type === "number" ? "number" : "text",
    inputmode: field.type === "number" ? "numeric" : undefined,
    min: field.min, max: field.max, step: field.step,
    maxlength: field.maxlength,
    required: field.required,
    autocomplete: "off",
    value: field.type === "list" ? (value || []).join(", ") : value ?? "",
    placeholder: field.name === "embedding_model" ? server?.kb.embedding_model : field.type === "list" ? "e.g. policies, handbook" : undefined,
  });
}

/** The form; `kb` given: edit that KB (Save, reindex warning, Delete). */
export function kbForm({ kb = null, documents = null, server = null, onSaved, pause, resume }) {
  const initial = kb || server.kb;
  const inputs = {};
  const errors = {};
  const formError = h("div.alert.alert-error", { role: "alert", hidden: true });
  const warning = h("div.alert.alert-warning", { role: "status", hidden: true });
  const submit = h("button.btn.btn-primary", { type: "submit" }, kb ? "Save" : "Create");

  function values() {
    const out = {};
    for (const field of FIELDS) {
      const raw = inputs[field.name].value;
      if (field.type === "number") out[field.name] = raw === "" ? null : Number(raw);
      else if (field.type === "list") out[field.name] = splitList(raw);
      else out[field.name] = raw.trim();
    }
    if (!out.embedding_model) out.embedding_model = kb ? kb.embedding_model : server.kb.embedding_model;
    return out;
  }

  function updateWarning() {
    if (!kb) return;
    const now = values();
    const changed = REINDEX.filter((k) => String(now[k]) !== String(kb[k]));
    warning.hidden = changed.length === 0;
    const labels = changed.map((k) => FIELDS.find((f) => f.name === k).label.toLowerCase());
    const what = labels.length > 1 ? `${labels.slice(0, -1).join(", ")} and ${labels.at(-1)}` : labels[0];
    const count = documents === null ? "every document" : `all ${documents} document${documents === 1 ? "" : "s"}`;
    warning.textContent = `Changing the ${what} reindexes ${count} of this knowledge base. Searches keep answering from the current index meanwhile.`;
  }

  function onInput() {
    updateWarning();
    applyLimits();
  }

  const rows = FIELDS.map((field) => {
    const input = control(field, initial[field.name], onInput, server);
    inputs[field.name] = input;
    errors[field.name] = h("p.field-error", { id: `${input.id}-error`, hidden: true });
    return h(
      `div.field.field-${field.name}`,
      h("label", { for: input.id }, field.label, field.required ? h("span.req", { "aria-hidden": "true" }, " *") : null),
      input,
      h("p.help", { id: `${input.id}-help` }, field.help),
      errors[field.name],
    );
  });

  // The server's limits on the inputs, the chunk size's by the model chosen (a model the
  // server does not list keeps the general limit; the server still has the last word).
  function applyLimits() {
    const l = server.limits;
    const model = inputs.embedding_model.value.trim() || server.kb.embedding_model;
    const known = server.models.find((m) => m.embedding_model === model);
    inputs.chunk_size.min = l.chunk_size_min;
    inputs.chunk_size.max = known ? known.max_chunk_size : l.chunk_size_max;
    inputs.coalesce_neighbors.max = l.coalesce_neighbors_max;
  }
  if (server) applyLimits();
  else defaults().then((got) => { server = got; applyLimits(); }, () => {});

  function showErrors(err) {
    const byField = err.fieldErrors ? err.fieldErrors() : {};
    let shown = false;
    for (const [name, message] of Object.entries(byField)) {
      if (!errors[name]) continue;
      errors[name].textContent = message;
      errors[name].hidden = false;
      inputs[name].setAttribute("aria-invalid", "true");
      if (!shown) inputs[name].focus();
      shown = true;
    }
    if (!shown) {
      formError.textContent = err.message;
      formError.hidden = false;
    }
  }

  function resetErrors() {
    formError.hidden = true;
    for (const [name, el] of Object.entries(errors)) {
      el.hidden = true;
      el.textContent = "";
      inputs[name].removeAttribute("aria-invalid");
    }
  }

  const form = h(
    "form.kbform",
    {
      novalidate: true,
      onsubmit: async (e) => {
        e.preventDefault();
        resetErrors();
        const body = values();
        for (const k of Object.keys(body)) if (body[k] === null) delete body[k];
        if (kb) {
          // Send what changed only: an unchanged name is not a rename.
          for (const k of Object.keys(body)) if (JSON.stringify(body[k]) === JSON.stringify(kb[k])) delete body[k];
        }
        submit.disabled = true;
        try {
          const saved = kb
            ? await api("PATCH", `/v1/kbs/${encodeURIComponent(kb.kb_id)}`, body)
            : await api("POST", "/v1/kbs", body);
          onSaved(saved);
        } catch (err) {
          showErrors(err);
        } finally {
          submit.disabled = false;
        }
      },
    },
    formError,
    h("div.form-grid", rows),
    warning,
    h("div.form-actions", submit, kb ? null : h("a.btn", { href: "#/kbs" }, "Cancel")),
  );
  updateWarning();

  if (!kb) return form;
  const danger = h(
    "section.danger-zone",
    { "aria-labelledby": nextId("danger") },
    h("h3", "Delete this knowledge base"),
    h("p", "Its index is dropped. The documents stay in your organisation and in any other knowledge base whose tags they carry."),
    h("button.btn.btn-danger", { type: "button", onclick: () => deleteKb(kb, { before: pause, failed: resume }) }, "Delete knowledge base"),
  );
  danger.querySelector("h3").id = danger.getAttribute("aria-labelledby");
  return h("div", form, danger);
}

/** Confirm, then delete; `before` runs (awaited) right before the DELETE, `failed` if it fails. */
export async function deleteKb(kb, { before, failed } = {}) {
  const done = await confirmDialog(
    `Delete “${kb.name}”?`,
    "The knowledge base and its index are removed; searches stop finding its chunks. This cannot be undone.",
    "Delete",
    async () => {
      if (before) await before();
      try {
        return await api("DELETE", `/v1/kbs/${encodeURIComponent(kb.kb_id)}`);
      } catch (err) {
        if (failed) failed();
        throw err;
      }
    },
  );
  if (!done) return;
  toast(`Knowledge base “${kb.name}” deleted`);
  location.hash = "#/kbs";
}
