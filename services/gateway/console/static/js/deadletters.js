// Dead letters: messages kbmesh set aside, with the reason, and Replay once the cause is fixed.
import { api, query } from "./api.js";
import { clear, h } from "./dom.js";
import { emptyState, errorBox, pageHeader, setView, table, toast, when } from "./ui.js";

export async function renderDeadLetters(main) {
  document.title = "Dead letters · kbmesh";
  const results = h("div.results");
  const subject = h("select#dl-subject", { onchange: () => load() },
    h("option", { value: "" }, "All subjects"),
    ["doc.uploaded", "ocr.done", "tags.changed", "doc.deleted", "kb.changed", "kb.index", "kb.remove"].map((s) => h("option", { value: s }, s)));

  setView(
    main,
    pageHeader("Dead letters", {
      sub: h("p.lead", "Messages that could not be processed, with the reason. Fix the cause (create the missing knowledge base, bring the provider back), then replay them."),
      actions: h("button.btn", { type: "button", onclick: () => load() }, "Refresh"),
    }),
    h("div.toolbar", h("div.field-inline", h("label", { for: "dl-subject" }, "Subject"), subject)),
    results,
  );

  async function replay(letter, button) {
    button.disabled = true;
    try {
      await api("POST", `/v1/dead-letters/${letter.sequence}/replay`);
      toast(`Replayed ${letter.subject} #${letter.sequence}`);
      load();
    } catch (err) {
      toast(err.message, "error");
      button.disabled = false;
    }
  }

  async function load() {
    let page;
    try {
      page = await api("GET", `/v1/dead-letters${query({ subject: subject.value, limit: 500 })}`);
    } catch (err) {
      clear(results).append(errorBox(err));
      return;
    }
    clear(results);
    if (!page.items.length) {
      results.append(emptyState("No dead letters", "Everything sent to kbmesh was processed."));
      return;
    }
    results.append(table(
      [
        { label: "When", cell: (d) => when(d.time), className: "nowrap" },
        { label: "Subject", cell: (d) => h("code", d.subject) },
        { label: "Document", cell: (d) => d.name || d.document_id || h("span.muted", "—") },
        { label: "Reason", cell: (d) => h("span.reason-cell", h("span.error-type", d.error_type || "Error"), h("span", d.error)), className: "col-reason" },
        { label: "Tries", cell: (d) => String(d.delivered), className: "num" },
        {
          label: "Actions",
          className: "col-actions",
          cell: (d) => {
            const b = h("button.btn.btn-small", { type: "button", "aria-label": `Replay ${d.subject} #${d.sequence}` }, "Replay");
            b.addEventListener("click", () => replay(d, b));
            return b;
          },
        },
      ],
      page.items,
      { caption: "Dead letters", rowAttrs: (d) => ({ "data-sequence": String(d.sequence) }) },
    ));
  }

  await load();
  return null;
}
