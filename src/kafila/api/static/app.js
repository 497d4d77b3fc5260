// The host's web page: the ring from /status (polled), the timeline from /events (server-sent
// events), and a chat box on /v1/chat/completions. Plain JS, no build step; every text from the
// server goes in through textContent (member names come from other machines).
"use strict";

const POLL_MS = 2000;
const HISTORY_MS = 5 * 60 * 1000;
const MAX_TIMELINE = 200;
const SVG = "http://www.w3.org/2000/svg";
const $ = (id) => document.getElementById(id);

let model = null;
let lastEventId = 0;
const samples = [];
const conversation = [];

// --- the API key, where the host asks for one -----------------------------------------------

function headers(extra) {
  const key = sessionStorage.getItem("kafila-key");
  return Object.assign(key ? { Authorization: "Bearer " + key } : {}, extra || {});
}

async function api(path, options) {
  const response = await fetch(path, Object.assign({}, options, { headers: headers(options && options.headers) }));
  if (response.status === 401) $("key-form").hidden = false;
  return response;
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem("kafila-key", $("key").value);
  $("key-form").hidden = true;
  poll();
  follow();
});

// --- server-sent events, read from a fetch body (EventSource cannot send the API key) --------

async function* sseMessages(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const message = { id: null, data: [] };
      for (const line of block.split("\n")) {
        if (line.startsWith("data:")) message.data.push(line.slice(5).replace(/^ /, ""));
        else if (line.startsWith("id:")) message.id = line.slice(3).trim();
      }
      if (message.data.length) yield { id: message.id, data: message.data.join("\n") };
    }
  }
}

// --- /status: the ring, the stages, the load -------------------------------------------------

async function poll() {
  try {
    const response = await api("/status");
    if (!response.ok) throw new Error("/status answered " + response.status);
    render(await response.json());
  } catch (error) {
    setState("unreachable", "failed");
  }
}

function setState(text, kind) {
  const state = $("state");
  state.textContent = text;
  state.className = "pill " + kind;
}

function render(status) {
  model = status.model;
  $("model").textContent = status.model;
  if (status.ready) setState("ready", "ready");
  else if (status.error) setState("failed: " + status.error, "failed");
  else setState("waiting for " + (status.waiting_for || []).join(", "), "waiting");
  drawRing(status);
  fillStages(status);
  const now = Date.now();
  samples.push({ t: now, rate: status.tokens_per_s || 0, queue: status.queue_depth || 0 });
  while (samples.length && samples[0].t < now - HISTORY_MS) samples.shift();
  $("rate-now").textContent = (status.tokens_per_s || 0).toFixed(1);
  $("queue-now").textContent = String(status.queue_depth || 0);
  const dialects = Object.entries(status.requests_by_dialect || {}).sort();
  $("dialects").textContent = dialects.length ? dialects.map(([name, count]) => name + " " + count).join(", ") : "none yet";
  spark($("rate"), samples.map((s) => [s.t, s.rate]), now);
  spark($("queue"), samples.map((s) => [s.t, s.queue]), now);
}

function el(tag, attrs, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [name, value] of Object.entries(attrs || {})) node.setAttribute(name, value);
  if (text !== undefined) node.textContent = text;
  return node;
}

function shortName(name) {
  return name.length > 16 ? name.slice(0, 15) + "…" : name;
}

function blocksText(blocks) {
  return blocks ? "blocks " + blocks[0] + "–" + (blocks[1] - 1) : "";
}

function drawRing(status) {
  const svg = $("ring");
  svg.replaceChildren();
  const members = status.members || [];
  const order = (status.plan && status.plan.ring) || [];
  const byName = new Map(members.map((m) => [m.name, m]));
  const names = order.filter((n) => byName.has(n)).concat(members.map((m) => m.name).filter((n) => !order.includes(n)));
  const cx = 220, cy = 160, radius = names.length > 1 ? 115 : 0, r = 34;
  const at = new Map(names.map((name, i) => {
    const angle = -Math.PI / 2 + (2 * Math.PI * i) / Math.max(1, names.length);
    return [name, [cx + radius * Math.cos(angle), cy + radius * Math.sin(angle)]];
  }));
  const defs = el("defs");
  const marker = el("marker", { id: "arrow", viewBox: "0 0 10 10", refX: "9", refY: "5", markerWidth: "7",
    markerHeight: "7", orient: "auto-start-reverse" });
  marker.append(el("path", { d: "M0,0 L10,5 L0,10 z", fill: "#66717e" }));
  defs.append(marker);
  svg.append(defs);
  for (const edge of status.edges || []) {
    const from = at.get(edge.from), to = at.get(edge.to);
    if (!from || !to) continue;
    const dx = to[0] - from[0], dy = to[1] - from[1], length = Math.hypot(dx, dy) || 1;
    const ux = dx / length, uy = dy / length;
    // Each link a little to its right (two members' links both ways stay apart), its label on
    // the side away from the ring's middle, or on its own side where the link goes both ways.
    const px = -uy, py = ux, mx = (from[0] + to[0]) / 2, my = (from[1] + to[1]) / 2;
    const pair = (status.edges || []).some((e) => e.from === edge.to && e.to === edge.from);
    const side = !pair && (mx - cx) * px + (my - cy) * py < 0 ? -1 : 1;
    const relayed = (edge.path || "").startsWith("relay");
    const group = el("g", { class: "link", "data-from": edge.from, "data-to": edge.to });
    group.append(el("line", { class: "edge" + (relayed ? " relayed" : ""), x1: from[0] + ux * r + px * 4,
      y1: from[1] + uy * r + py * 4, x2: to[0] - ux * (r + 2) + px * 4, y2: to[1] - uy * (r + 2) + py * 4,
      "marker-end": "url(#arrow)" }));
    const rtt = edge.rtt_ms != null ? " " + edge.rtt_ms.toFixed(1) + " ms" : "";
    const away = 14 + 34 * Math.abs(px); // a label is wide: further from an upright link
    group.append(el("text", { class: "edge-label", x: mx + side * px * away, y: my + side * py * away + 4,
      "text-anchor": "middle" }, (edge.path || "") + rtt));
    svg.append(group);
  }
  for (const name of names) {
    const member = byName.get(name);
    const [x, y] = at.get(name);
    const kinds = ["node"];
    if (member.host) kinds.push("host");
    if (member.left) kinds.push("left");
    else if (member.link === "down") kinds.push("down");
    if (member.joining) kinds.push("joining");
    const standby = member.role === "stands-by";
    if (standby) kinds.push("standby");
    const group = el("g", { class: kinds.join(" "), "data-member": name });
    group.append(el("title", {}, standby && member.why ? member.why : name));
    group.append(el("circle", { cx: x, cy: y, r: r }));
    group.append(el("text", { class: "name", x: x, y: y - 4, "text-anchor": "middle" }, shortName(name)));
    const head = status.plan && status.plan.head === name ? " · head" : "";
    const sub = member.left ? "left" : member.joining ? "joining" : standby ? "stands by"
      : blocksText(member.blocks) + head;
    group.append(el("text", { class: "sub", x: x, y: y + 11, "text-anchor": "middle" }, sub));
    svg.append(group);
  }
  const plan = status.plan;
  const count = members.filter((m) => !m.left).length;
  const counted = `${count} member${count === 1 ? "" : "s"}`;
  $("ring-note").textContent = plan
    ? `plan ${plan.tier}, epoch ${status.epoch ?? "–"}, ${counted}` +
      (plan.standby && plan.standby.length ? ` (${plan.standby.length} standing by)` : "") +
      (plan.predicted_bottleneck_ms != null ? `, predicted bottleneck ${plan.predicted_bottleneck_ms} ms` : "")
    : count ? counted : "one machine";
}

// Where a member's stage file came from, its size and how long that took: "hub, 12.3 MB in 4.1 s".
function stageFrom(member) {
  if (member.stage_source == null) return "–";
  const size = member.stage_bytes != null ? `, ${(member.stage_bytes / 1e6).toFixed(1)} MB` : "";
  const took = member.stage_seconds != null ? ` in ${member.stage_seconds.toFixed(1)} s` : "";
  return member.stage_source + size + took;
}

// The load the ring was planned for, what it serves, and the last weighing of who serves at it.
function loadNote(load) {
  const users = (n) => `${n} request${n === 1 ? "" : "s"} at once`;
  const measured = load.measured != null ? `, serving ${load.measured.toFixed(1)}` : "";
  return `planned for ${users(load.planned)}${measured}` + (load.reason ? ` (${load.reason})` : "");
}

function fillStages(status) {
  const measured = new Map((status.stages || []).map((s) => [s.range.join("-"), s]));
  let rows = (status.members || []).filter((m) => m.blocks).map((m) => ({
    name: m.name, blocks: m.blocks, predicted: m.predicted_ms_per_token, stage: measured.get(m.blocks.join("-")),
    from: stageFrom(m), why: m.stage_why,
  }));
  if (!rows.length) rows = (status.stages || []).map((s) => ({ name: "this machine", blocks: s.range, predicted: null, stage: s, from: "–" }));
  rows.sort((a, b) => a.blocks[0] - b.blocks[0]);
  const body = document.querySelector("#stages tbody");
  body.replaceChildren();
  for (const row of rows) {
    const ms = row.stage ? row.stage.ms_per_token_alone ?? row.stage.ms_per_token : null;
    const tr = document.createElement("tr");
    const cells = [row.name, `${row.blocks[0]}–${row.blocks[1] - 1}`, ms != null ? ms.toFixed(3) : "–",
      row.predicted != null ? row.predicted.toFixed(3) : "–", row.from];
    for (const text of cells) {
      const td = document.createElement("td");
      td.textContent = text;
      tr.append(td);
    }
    if (ms != null && row.predicted != null && ms > 1.5 * row.predicted) tr.children[2].className = "slow";
    if (row.why) tr.children[4].title = row.why; // why its stage came from the host, not the hub
    body.append(tr);
  }
  const notes = [];
  if (status.rebalance) notes.push("last rebalance verdict: " + status.rebalance.reason);
  if (status.load) notes.push(loadNote(status.load));
  $("plan-note").textContent = notes.join("; ");
}

function spark(svg, points, now) {
  svg.replaceChildren();
  const top = Math.max(1, ...points.map((p) => p[1]));
  const path = points.map(([t, v]) => `${(300 * (t - (now - HISTORY_MS))) / HISTORY_MS},${58 - (54 * v) / top}`);
  if (path.length) svg.append(el("polyline", { class: "spark", points: path.join(" ") }));
  svg.append(el("text", { x: 4, y: 12 }, "max " + (Number.isInteger(top) ? top : top.toFixed(1))));
}

// --- /events: the timeline ---------------------------------------------------------------------

function addEvent(event) {
  const item = document.createElement("li");
  item.className = event.kind;
  item.dataset.kind = event.kind;
  const time = document.createElement("time");
  time.textContent = new Date(event.at * 1000).toLocaleTimeString();
  item.append(time, document.createTextNode(event.text));
  if (event.detail) {
    const detail = document.createElement("span");
    detail.className = "detail";
    detail.textContent = event.detail;
    item.append(detail);
  }
  const list = $("timeline");
  list.prepend(item);
  while (list.children.length > MAX_TIMELINE) list.lastElementChild.remove();
}

let following = false;

async function follow() {
  if (following) return;
  following = true;
  try {
    const response = await api("/events", { headers: { "Last-Event-ID": String(lastEventId) } });
    if (!response.ok) throw new Error("/events answered " + response.status);
    for await (const message of sseMessages(response)) {
      const event = JSON.parse(message.data);
      if (event.id <= lastEventId) continue;
      lastEventId = event.id;
      addEvent(event);
    }
  } catch (error) {
    // the host restarted or is unreachable: try again below
  } finally {
    following = false;
  }
  setTimeout(follow, 2000);
}

// --- the chat box --------------------------------------------------------------------------------

function bubble(kind, text) {
  const div = document.createElement("div");
  div.className = "message " + kind;
  div.textContent = text;
  $("chat-log").append(div);
  return div;
}

async function chat(text) {
  conversation.push({ role: "user", content: text });
  bubble("user", text);
  const answer = bubble("assistant", "");
  $("send").disabled = true;
  try {
    const response = await api("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ model: model, messages: conversation, stream: true }),
    });
    if (!response.ok) {
      const body = await response.json().catch(() => ({}));
      throw new Error((body.error && body.error.message) || "the server answered " + response.status);
    }
    for await (const message of sseMessages(response)) {
      if (message.data === "[DONE]") break;
      const chunk = JSON.parse(message.data);
      if (chunk.error) throw new Error(chunk.error.message);
      const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
      if (delta && delta.content) {
        answer.textContent += delta.content;
        $("chat-log").scrollTop = $("chat-log").scrollHeight;
      }
    }
    answer.classList.add("done");
    conversation.push({ role: "assistant", content: answer.textContent });
  } catch (error) {
    conversation.pop();
    answer.className = "message error";
    answer.textContent = String(error.message || error);
  } finally {
    $("send").disabled = false;
  }
}

$("chat").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || !model) return;
  $("prompt").value = "";
  chat(text);
});

$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("chat").requestSubmit();
  }
});

poll();
setInterval(poll, POLL_MS);
follow();
