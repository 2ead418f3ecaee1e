// Building DOM from data. Every value becomes a text node or a property: nothing is ever
// parsed as HTML, so a document named "<img src=x onerror=alert(1)>" shows as those characters.

/** h("tag.class#id", {attr: value, onclick: fn}, ...children) */
export function h(spec, attrs, ...children) {
  const [, tag = "div", rest = ""] = /^([a-z0-9-]+)?(.*)$/i.exec(spec);
  const el = document.createElement(tag);
  for (const part of rest.match(/[.#][^.#]+/g) || []) {
    if (part[0] === ".") el.classList.add(part.slice(1));
    else el.id = part.slice(1);
  }
  if (attrs && (typeof attrs !== "object" || attrs instanceof Node || Array.isArray(attrs))) {
    children.unshift(attrs);
    attrs = null;
  }
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key.startsWith("on") && typeof value === "function") {
      el.addEventListener(key.slice(2), value);
    } else if (key === "class") {
      for (const c of String(value).split(/\s+/).filter(Boolean)) el.classList.add(c);
    } else if (key === "dataset") {
      Object.assign(el.dataset, value);
    } else if (key === "value" || key === "checked" || key === "disabled" || key === "hidden"
      || key === "multiple" || key === "selected" || key === "required") {
      el[key] = value;
    } else {
      el.setAttribute(key, value === true ? "" : String(value));
    }
  }
  append(el, children);
  return el;
}

export function append(el, children) {
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

export function clear(el) {
  while (el.firstChild) el.firstChild.remove();
  return el;
}

const STOPWORDS = new Set(
  "a an and are as at be but by for from has have how in into is it its of on or that the their this to was were what when where which who why will with".split(" "),
);

/** Text with the query's words (whole words, and their longer forms) wrapped in <mark>. */
export function highlighted(text, query) {
  const words = [...new Set(String(query).toLowerCase().match(/[\p{L}\p{N}]+/gu) || [])]
    .filter((w) => w.length > 1 && !STOPWORDS.has(w));
  if (!words.length) return [String(text)];
  const escaped = words.map((w) => w.replace(/[.*+?^${}()|[\]\\]/g, "\\$&"));
  const re = new RegExp(`(?<![\\p{L}\\p{N}])((?:${escaped.join("|")})[\\p{L}\\p{N}]*)`, "giu");
  return String(text).split(re).map((piece, i) => (i % 2 ? h("mark", piece) : piece));
}

let uid = 0;
export function nextId(prefix) {
  uid += 1;
  return `${prefix}-${uid}`;
}
