// Shared pieces of the pages: badges, tables, pagination, dialogs, toasts, dates.
import { clear, h } from "./dom.js";

const KB_STATUS = {
  active: ["Active", "green"],
  indexing: ["Indexing", "yellow"],
  error: ["Error", "red"],
  pending_reindex: ["Pending reindex", "grey"],
};

const DOC_STATUS = {
  complete: ["Indexed", "green"],
  processing: ["Indexing", "yellow"],
  pending: ["Indexing", "yellow"],
  awaiting_ocr: ["Awaiting OCR", "blue"],
  failed: ["Failed", "red"],
  pending_reindex: ["Pending reindex", "grey"],
  stored: ["Stored", "grey"],
  ready: ["Indexed", "green"],
};

export const KB_STATUSES = Object.entries(KB_STATUS).map(([value, [label]]) => ({ value, label }));

function badge([label, color]) {
  return h(`span.badge.badge-${color}`, label);
}

export function kbBadge(status) {
  return badge(KB_STATUS[status] || [String(status), "grey"]);
}

export function docBadge(status) {
  return badge(DOC_STATUS[status] || [String(status), "grey"]);
}

export function docStatusLabel(status) {
  return (DOC_STATUS[status] || [String(status)])[0];
}

const dateFmt = new Intl.DateTimeFormat(undefined, { dateStyle: "medium", timeStyle: "short" });
const numberFmt = new Intl.NumberFormat();

export function when(value) {
  if (!value) return "—";
  const d = new Date(value);
  return Number.isNaN(d.getTime()) ? String(value) : dateFmt.format(d);
}

/** "just now", "5 min ago", "3 h ago", else the date; the exact time on hover. */
export function ago(value) {
  if (!value) return "—";
  const d = new Date(value);
  const seconds = (Date.now() - d.getTime()) / 1000;
  let text = when(value);
  if (seconds < 60) text = "just now";
  else if (seconds < 3600) text = `${Math.floor(seconds / 60)} min ago`;
  else if (seconds < 86400) text = `${Math.floor(seconds / 3600)} h ago`;
  return h("span", { title: when(value) }, text);
}

export function num(value) {
  return value === null || value === undefined ? "—" : numberFmt.format(value);
}

export function tagList(tags) {
  if (!tags || !tags.length) return h("span.muted", "—");
  return h("span.tags", tags.map((t) => h("span.tag", t)));
}

/**
 * A table that turns into labelled cards on narrow screens.
 * columns: [{label, cell(row) -> Node|string, className}]
 */
export function table(columns, rows, { caption, rowAttrs } = {}) {
  return h(
    "div.table-wrap",
    h(
      "table.data",
      caption ? h("caption.visually-hidden", caption) : null,
      h("thead", h("tr", columns.map((c) => h("th", { scope: "col", class: c.className }, c.head ?? c.label)))),
      h(
        "tbody",
        rows.map((row) =>
          h(
            "tr",
            rowAttrs ? rowAttrs(row) : null,
            columns.map((c) =>
              h("td", { "data-label": c.label, class: c.className }, c.cell(row)),
            ),
          ),
        ),
      ),
    ),
  );
}

export function emptyState(title, text, action) {
  return h("div.empty", h("h3", title), text ? h("p", text) : null, action || null);
}

export function errorBox(err) {
  if (err.status === 401) return h("div.alert.alert-info", "Enter an API key above to see this page.");
  return h("div.alert.alert-error", { role: "alert" }, err.message || String(err));
}

/** Page n of a list: "1–20 of 43" with Previous / Next. */
export function pager({ skip, limit, total, onPage }) {
  if (total <= limit) {
    return h("div.pager", h("span.muted", total === 1 ? "1 item" : `${num(total)} items`));
  }
  const last = Math.min(skip + limit, total);
  return h(
    "nav.pager",
    { "aria-label": "Pagination" },
    h("span.muted", `${num(skip + 1)}–${num(last)} of ${num(total)}`),
    h(
      "span.pager-buttons",
      h("button.btn.btn-small", { type: "button", disabled: skip === 0, onclick: () => onPage(Math.max(0, skip - limit)) }, "Previous"),
      h("button.btn.btn-small", { type: "button", disabled: last >= total, onclick: () => onPage(skip + limit) }, "Next"),
    ),
  );
}

export function toast(message, kind = "ok") {
  const box = document.getElementById("toasts");
  const el = h(`div.toast.toast-${kind}`, message);
  box.append(el);
  setTimeout(() => el.remove(), kind === "error" ? 8000 : 4000);
}

/** A modal built from a <dialog>; resolves with the button's value or null. */
export function modal({ title, body, confirm = "OK", dismiss = "Cancel", danger = false, onSubmit }) {
  return new Promise((resolve) => {
    const error = h("div.alert.alert-error", { role: "alert", hidden: true });
    const dialog = h("dialog.modal", { "aria-labelledby": "modal-title" });
    const close = (value) => {
      dialog.close();
      dialog.remove();
      resolve(value);
    };
    const form = h(
      "form",
      {
        method: "dialog",
        onsubmit: async (e) => {
          e.preventDefault();
          if (!onSubmit) return close(true);
          submitBtn.disabled = true;
          try {
            close(await onSubmit());
          } catch (err) {
            error.textContent = err.message;
            error.hidden = false;
            submitBtn.disabled = false;
          }
        },
      },
      h("h2#modal-title", title),
      h("div.modal-body", body),
      error,
      h(
        "div.modal-actions",
        h("button.btn.modal-dismiss", { type: "button", onclick: () => close(null) }, dismiss),
        null,
      ),
    );
    const submitBtn = h(`button.btn.${danger ? "btn-danger" : "btn-primary"}`, { type: "submit" }, confirm);
    form.querySelector(".modal-actions").append(submitBtn);
    dialog.append(form);
    dialog.addEventListener("cancel", (e) => {
      e.preventDefault();
      close(null);
    });
    document.body.append(dialog);
    dialog.showModal();
    // A destructive action is never one keypress away: Enter on open cancels it.
    const safe = danger ? dialog.querySelector(".modal-dismiss") : submitBtn;
    (dialog.querySelector("input, select, textarea") || safe).focus();
  });
}

export function confirmDialog(title, text, confirm, onSubmit, dismiss = "Cancel") {
  return modal({ title, body: h("p", text), confirm, dismiss, danger: true, onSubmit });
}

export function pageHeader(title, { crumbs, actions, sub } = {}) {
  return h(
    "div.page-header",
    crumbs ? h("nav.crumbs", { "aria-label": "Breadcrumb" }, crumbs) : null,
    h("div.page-title-row", h("h1", title), actions ? h("div.actions", actions) : null),
    sub || null,
  );
}

export function setView(main, ...nodes) {
  clear(main);
  main.append(...nodes.flat().filter(Boolean));
}

/** Split "a, b ,c" into ["a","b","c"]. */
export function splitList(value) {
  return String(value || "")
    .split(",")
    .map((s) => s.trim())
    .filter(Boolean);
}

/** The "Name" search box of a list: onSearch(text) after each change, back to page one. */
export function nameSearch(id, state, onSearch) {
  const input = h(`input#${id}`, {
    type: "search",
    placeholder: "Search by name",
    autocomplete: "off",
    oninput: () => {
      state.search = input.value;
      state.skip = 0;
      onSearch();
    },
  });
  return h("div.field-inline", h("label", { for: id }, "Name"), input);
}
