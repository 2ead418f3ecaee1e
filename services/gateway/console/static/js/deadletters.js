// Dead letters: messages kbmesh set aside, with the reason, and Replay once the cause is fixed.
import { api, query } from "./api.js";
import { clear, h } from "./dom.js";
import { confirmDialog, emptyState, errorBox, modal, pageHeader, setView, table, toast, when } from "./ui.js";

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

  const same = (a, b) => a.subject === b.subject && a.document_id === b.document_id && a.name === b.name;

  async function replay(letter, button) {
    button.disabled = true;
    let before;
    try {
      before = new Set((await list()).items.map((d) => d.sequence));
      await api("POST", `/v1/dead-letters/${letter.sequence}/replay`);
    } catch (err) {
      toast(err.message, "error");
      button.disabled = false;
      return;
    }
    // A replay whose cause is not fixed fails again at once: look before saying it worked.
    toast(`Replayed ${letter.subject} #${letter.sequence}; checking…`);
    load();
    let again = null;
    for (let i = 0; i < 6 && !again; i++) {
      await new Promise((resolve) => setTimeout(resolve, 500));
      const now = await list().catch(() => ({ items: [] }));
      again = now.items.find((d) => !before.has(d.sequence) && same(d, letter)) || null;
    }
    if (again) toast(`Replayed #${letter.sequence}, but it failed again: ${again.error}`, "error");
    else toast(`Replayed ${letter.subject} #${letter.sequence}: it did not fail again`);
    load();
  }

  async function view(letter) {
    const full = await api("GET", `/v1/dead-letters/${letter.sequence}`).catch((err) => {
      toast(err.message, "error");
      return null;
    });
    if (!full) return;
    const note = full.body_truncated ? " (first 64 KB)" : "";
    await modal({
      title: `${letter.subject} #${letter.sequence}`,
      body: h("div",
        h("p", h("strong", `${full.error_type}: `), full.error),
        h("p.muted", `Body, ${full.body_encoding === "base64" ? "base64" : "as sent"}${note}:`),
        h("pre.dl-body", { tabindex: "0" }, full.body)),
      confirm: "Close",
      dismiss: "Back",
    });
  }

  async function discard(letter) {
    const done = await confirmDialog(
      `Discard ${letter.subject} #${letter.sequence}?`,
      "The message is removed without being processed; it cannot be replayed afterwards.",
      "Discard",
      () => api("DELETE", `/v1/dead-letters/${letter.sequence}`),
    );
    if (!done) return;
    toast(`Discarded ${letter.subject} #${letter.sequence}`);
    load();
  }

  const list = () => api("GET", `/v1/dead-letters${query({ subject: subject.value, limit: 500 })}`);

  async function load() {
    let page;
    try {
      page = await list();
    } catch (err) {
      clear(results).append(errorBox(err));
      return;
    }
    clear(results);
    if (page.without_org) {
      results.append(h("div.alert.alert-warning", { role: "status" },
        `${page.without_org} dead letter${page.without_org === 1 ? "" : "s"} name no organisation `
        + "(messages that are not kbmesh events), so no one sees them here; operators list them "
        + "with `kbmesh dlq list`."));
    }
    if (!page.items.length) {
      results.append(page.without_org
        ? emptyState("No dead letters of yours", "None of your messages failed.")
        : emptyState("No dead letters", "Everything sent to kbmesh was processed."));
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
            return h("span.row-actions",
              b,
              h("button.btn.btn-small.btn-ghost", { type: "button", "aria-label": `View ${d.subject} #${d.sequence}`, onclick: () => view(d) }, "View"),
              h("button.btn.btn-small.btn-danger-ghost", { type: "button", "aria-label": `Discard ${d.subject} #${d.sequence}`, onclick: () => discard(d) }, "Discard"));
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
