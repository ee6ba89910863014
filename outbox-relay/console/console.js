// The outbox console. Every value from the relay reaches the page through
// textContent or an attribute, never as markup: an event's payload or error text
// holding HTML shows as text. The token stays in this page's memory (no cookie,
// no storage) and goes out only in the Authorization header of an action.
"use strict";

const REFRESH_MS = 5000;
const SVG = "http://www.w3.org/2000/svg";
let token = "";
let writable = false;
let overviewTimer = null;
let pendingAction = null;
// The page of one outbox's dead letters shown, when not the first: { outbox, after }.
let page = null;

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value !== undefined && value !== null) node.setAttribute(key, String(value));
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, String(value));
  if (text !== undefined) node.textContent = String(text);
  return node;
}

function status(text, isError) {
  const node = document.getElementById("status");
  node.textContent = text || "";
  node.className = isError ? "error" : "";
}

async function api(path, options) {
  const response = await fetch(path, options);
  const body = await response.json().catch(() => ({}));
  if (!response.ok) {
    throw new Error(`${response.status}: ${body.error || response.statusText}`);
  }
  return body;
}

function age(seconds) {
  if (seconds === null || seconds === undefined) return "-";
  const s = Math.floor(seconds);
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m ${s % 60}s`;
  if (s < 86400) return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
  return `${Math.floor(s / 86400)}d ${Math.floor((s % 86400) / 3600)}h`;
}

function rate(value) {
  if (value === null || value === undefined) return "-";
  return value >= 10 ? value.toFixed(0) : value.toFixed(1);
}

function cell(field, text, cls) {
  return el("td", { "data-field": field, class: cls }, text);
}

function brokerCell(broker) {
  if (broker.status === "up") return cell("broker", "up", "good");
  const text = `${broker.status} for ${age(broker.for_seconds)}: ${broker.reason}`;
  return cell("broker", text, broker.status === "down" ? "bad" : "warn");
}

function relayCell(row) {
  const relay = row.relay;
  let text = relay.share ? `share ${relay.share.index + 1} of ${relay.share.count} relays` : "whole backlog";
  let cls;
  if (relay.stalled_seconds !== null && relay.stalled_seconds > 60) {
    text += `; a claim loop stalled for ${age(relay.stalled_seconds)}`;
    cls = "bad";
  }
  if (row.wal) text += `; WAL slot ${row.wal.slot} ${row.wal.usable ? "usable" : "NOT usable"}`;
  if (row.wal && !row.wal.usable) cls = "bad";
  return cell("relay", text, cls);
}

function renderOverview(data) {
  writable = data.writable;
  const mode = document.getElementById("mode");
  mode.textContent = writable ? "actions need the token" : "read-only";
  mode.className = writable ? "badge writable" : "badge";
  document.getElementById("token-form").hidden = !writable;
  for (const id of ["retry", "purge"]) document.getElementById(id).disabled = !writable;
  const body = document.querySelector("#outboxes tbody");
  const rows = data.outboxes.map((row) => {
    const tr = el("tr", { "data-outbox": row.name });
    tr.append(cell("name", row.name), cell("kind", row.kind));
    if (row.error) {
      tr.append(el("td", { colspan: 9, class: "bad", "data-field": "error" }, row.error));
      return tr;
    }
    tr.append(
      cell("pending", row.pending, "num"),
      cell("oldest_pending_age", row.pending > 0 ? age(row.oldest_pending_age_seconds) : "-", "num"),
      cell("published_per_second", rate(row.published_per_second), "num"),
      cell("failures_per_second", rate(row.failures_per_second), row.failures_per_second > 0 ? "num bad" : "num"),
      cell("lag", row.lag_seconds === null ? "-" : `${row.lag_seconds.toFixed(2)}s`, "num"),
      cell("dead_letters", row.dead_letters, row.dead_letters > 0 ? "num bad" : "num"),
      cell("held_aggregates", row.held_aggregates, row.held_aggregates > 0 ? "num warn" : "num"),
      brokerCell(row.broker),
      relayCell(row),
    );
    return tr;
  });
  body.replaceChildren(...rows);
  const names = data.outboxes.map((row) => row.name);
  fillSelect(document.getElementById("chart-outbox"), names, false);
  fillSelect(document.getElementById("filter-outbox"), names, true);
}

// Keep the chosen option when the list is the same.
function fillSelect(select, names, withAll) {
  const current = select.value;
  const wanted = (withAll ? [""] : []).concat(names);
  const have = Array.from(select.options).map((o) => o.value);
  if (have.join("\n") === wanted.join("\n")) return;
  select.replaceChildren(...wanted.map((name) => el("option", { value: name }, name === "" ? "all" : name)));
  if (wanted.includes(current)) select.value = current;
}

function drawChart(history) {
  const box = document.getElementById("chart-box");
  const chosen = document.getElementById("chart-outbox").value;
  const points = (history.outboxes[chosen] || []);
  const width = 900, height = 260, left = 55, right = 55, top = 12, bottom = 28;
  const chart = svg("svg", { id: "chart", width, height, viewBox: `0 0 ${width} ${height}`, role: "img",
    "aria-label": `backlog and lag of ${chosen}`, "data-points": points.length });
  const now = Date.now();
  // From the first sample (at least the last minute), at most the last hour: a
  // relay started minutes ago shows its minutes across the whole width.
  const first = points.length > 0 ? points[0].at : now;
  const from = Math.max(now - history.span_seconds * 1000, Math.min(first, now - 60000));
  const x = (at) => left + ((at - from) / (now - from)) * (width - left - right);
  const maxOf = (values) => Math.max(1e-9, ...values.filter((v) => v !== null));
  const backlog = points.map((p) => p.pending);
  const lag = points.map((p) => p.lag_seconds);
  const backlogMax = Math.max(1, maxOf(backlog));
  const lagMax = maxOf(lag.concat([0.001]));
  const y = (value, max) => top + (1 - value / max) * (height - top - bottom);
  chart.append(
    svg("line", { class: "axis", x1: left, y1: height - bottom, x2: width - right, y2: height - bottom }),
    svg("line", { class: "axis", x1: left, y1: top, x2: left, y2: height - bottom }),
    svg("line", { class: "axis", x1: width - right, y1: top, x2: width - right, y2: height - bottom }),
    svg("text", { x: left - 4, y: top + 10, "text-anchor": "end" }, backlogMax.toFixed(0)),
    svg("text", { x: left - 4, y: height - bottom, "text-anchor": "end" }, "0"),
    svg("text", { x: width - right + 4, y: top + 10 }, `${lagMax.toFixed(2)}s`),
    svg("text", { x: width - right + 4, y: height - bottom }, "0s"),
    svg("text", { x: left, y: height - 8 }, `-${age((now - from) / 1000)}`),
    svg("text", { x: width - right, y: height - 8, "text-anchor": "end" }, "now"),
  );
  for (const [name, values, max] of [["backlog", backlog, backlogMax], ["lag", lag, lagMax]]) {
    const coordinates = [];
    const group = svg("g", { class: `series ${name}` });
    points.forEach((p, i) => {
      if (values[i] === null) return;
      const cx = x(p.at).toFixed(1), cy = y(values[i], max).toFixed(1);
      coordinates.push(`${cx},${cy}`);
      const dot = svg("circle", { class: `point ${name}`, cx, cy, r: 2 });
      dot.append(svg("title", {}, `${new Date(p.at).toLocaleTimeString()}: ${name} ${values[i]}`));
      group.append(dot);
    });
    if (coordinates.length > 1) chart.append(svg("polyline", { class: name, points: coordinates.join(" ") }));
    chart.append(group);
  }
  box.replaceChildren(chart);
}

async function refreshOverview() {
  try {
    const [overview, history] = await Promise.all([api("api/overview"), api("api/history")]);
    renderOverview(overview);
    drawChart(history);
    status(`updated ${new Date().toLocaleTimeString()}`);
  } catch (error) {
    status(`cannot read the relay: ${error.message}`, true);
  }
}

function filterQuery() {
  const form = document.getElementById("filters");
  const query = new URLSearchParams();
  for (const [key, value] of new FormData(form).entries()) {
    if (String(value).trim() !== "") query.set(key, String(value).trim());
  }
  return query;
}

async function searchLetters() {
  try {
    const query = filterQuery();
    if (page) {
      query.set("outbox", page.outbox);
      query.set("after", page.after);
    }
    const data = await api(`api/dead-letters?${query}`);
    const pages = [];
    const rows = [];
    let shown = 0, total = 0;
    for (const outbox of data.outboxes) {
      total += outbox.total;
      if (outbox.next_after) {
        const next = el("button", { type: "button", class: "next-page", "data-outbox": outbox.outbox },
          `Next page of ${outbox.outbox}`);
        next.addEventListener("click", () => {
          page = { outbox: outbox.outbox, after: outbox.next_after };
          searchLetters();
        });
        pages.push(next);
      }
      for (const letter of outbox.letters) {
        shown += 1;
        const check = el("input", { type: "checkbox", class: "pick", "data-outbox": outbox.outbox, "data-id": letter.id });
        const inspect = el("a", { class: "inspect", tabindex: 0, "data-id": letter.id }, letter.id);
        inspect.addEventListener("click", () => inspectLetter(outbox.outbox, letter.id));
        rows.push(el("tr", { "data-id": letter.id },
          el("td", {}, check), el("td", {}, outbox.outbox), el("td", {}, inspect),
          el("td", { "data-field": "event_type" }, letter.event_type),
          el("td", {}, `${letter.aggregate_type} ${letter.aggregate_id}`),
          el("td", { class: "num" }, letter.attempts),
          el("td", {}, new Date(letter.dead_at).toLocaleString()),
          el("td", { "data-field": "last_error" }, letter.last_error || "-")));
      }
    }
    document.querySelector("#letters tbody").replaceChildren(...rows);
    document.getElementById("check-all").checked = false;
    const summary = page
      ? `${shown} of ${total} dead letters of ${page.outbox}, a later page`
      : shown < total ? `${shown} of ${total} dead letters shown` : `${total} dead letter(s)`;
    const first = el("button", { type: "button", id: "first-page" }, "First page");
    first.addEventListener("click", () => {
      page = null;
      searchLetters();
    });
    document.getElementById("letters-count").replaceChildren(
      summary, " ", ...(page ? [first] : []), ...pages);
  } catch (error) {
    status(`cannot list dead letters: ${error.message}`, true);
  }
}

async function inspectLetter(outbox, id) {
  try {
    const letter = await api(`api/dead-letter?${new URLSearchParams({ outbox, id })}`);
    document.getElementById("letter-id").textContent = letter.id;
    const fields = [
      ["Outbox", letter.outbox], ["Event type", letter.event_type],
      ["Aggregate", `${letter.aggregate_type} ${letter.aggregate_id}`], ["Attempts", letter.attempts],
      ["Created at", letter.created_at], ["Dead at", letter.dead_at],
      ["Destination", letter.destination || "-"], ["Last error", letter.last_error || "-"],
    ];
    document.getElementById("letter-fields").replaceChildren(
      ...fields.flatMap(([name, value]) => [el("dt", {}, name), el("dd", { "data-field": name }, value)]));
    document.getElementById("letter-headers").textContent = JSON.stringify(letter.headers, null, 2);
    document.getElementById("letter-payload").textContent = letter.payload;
    document.getElementById("letter").hidden = false;
  } catch (error) {
    status(`cannot show dead letter ${id}: ${error.message}`, true);
  }
}

// What an action applies to: per outbox, the checked ids; with none checked, the
// filters (and the outbox chosen there, or every outbox).
function selections() {
  const checked = Array.from(document.querySelectorAll("#letters input.pick:checked"));
  if (checked.length > 0) {
    const byOutbox = new Map();
    for (const box of checked) {
      const ids = byOutbox.get(box.dataset.outbox) || [];
      ids.push(box.dataset.id);
      byOutbox.set(box.dataset.outbox, ids);
    }
    return Array.from(byOutbox, ([outbox, ids]) => ({ outbox, ids }));
  }
  const filters = Object.fromEntries(filterQuery().entries());
  if (filters.outbox) return [filters];
  return Array.from(document.getElementById("filter-outbox").options)
    .map((o) => o.value).filter((v) => v !== "").map((outbox) => ({ ...filters, outbox }));
}

async function post(action, selection, dryRun) {
  return api(`api/dead-letters/${action}`, {
    method: "POST",
    headers: { "Content-Type": "application/json", Authorization: `Bearer ${token}` },
    body: JSON.stringify({ ...selection, dry_run: dryRun }),
  });
}

// First a dry run: how many would change; then the confirmation does it.
async function startAction(action) {
  try {
    const chosen = selections();
    let count = 0;
    for (const selection of chosen) count += (await post(action, selection, true)).count;
    if (count === 0) {
      status(`no dead letters match; nothing to ${action}`);
      return;
    }
    pendingAction = { action, chosen };
    const what = action === "retry" ? "Retry (publish again)" : "Purge (delete for good)";
    document.getElementById("confirm-text").textContent = `${what} ${count} dead letter(s)?`;
    document.getElementById("confirm").hidden = false;
  } catch (error) {
    status(`${action}: ${error.message}`, true);
  }
}

async function confirmAction() {
  const task = pendingAction;
  pendingAction = null;
  document.getElementById("confirm").hidden = true;
  if (!task) return;
  try {
    let count = 0;
    for (const selection of task.chosen) count += (await post(task.action, selection, false)).count;
    status(`${count} dead letter(s) ${task.action === "retry" ? "retried" : "purged"}`);
    document.getElementById("letter").hidden = true;
    await searchLetters();
  } catch (error) {
    status(`${task.action}: ${error.message}`, true);
  }
}

function route() {
  const deadLetters = location.hash === "#dead-letters";
  document.getElementById("overview").hidden = deadLetters;
  document.getElementById("dead-letters").hidden = !deadLetters;
  if (deadLetters) searchLetters();
}

function start() {
  document.getElementById("token-form").addEventListener("submit", (event) => {
    event.preventDefault();
    token = document.getElementById("token").value.trim();
    status(token ? "token set for this page" : "token cleared");
  });
  document.getElementById("filters").addEventListener("submit", (event) => {
    event.preventDefault();
    page = null;
    searchLetters();
  });
  document.getElementById("check-all").addEventListener("change", (event) => {
    for (const box of document.querySelectorAll("#letters input.pick")) box.checked = event.target.checked;
  });
  document.getElementById("retry").addEventListener("click", () => startAction("retry"));
  document.getElementById("purge").addEventListener("click", () => startAction("purge"));
  document.getElementById("confirm-yes").addEventListener("click", confirmAction);
  document.getElementById("confirm-no").addEventListener("click", () => {
    pendingAction = null;
    document.getElementById("confirm").hidden = true;
    status("cancelled; nothing changed");
  });
  document.getElementById("chart-outbox").addEventListener("change", refreshOverview);
  window.addEventListener("hashchange", route);
  route();
  refreshOverview();
  overviewTimer = setInterval(refreshOverview, REFRESH_MS);
}

document.addEventListener("DOMContentLoaded", start);
