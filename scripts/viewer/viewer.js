// The trajectory viewer's page script (inlined by scripts/viewer/__init__.py). Every dump value is
// put in the page as text (textContent, createElement), never parsed as markup: a policy's text or a
// retrieved page can hold anything.
"use strict";
async function loadData() {
  // The data: gzip + base64 (inflated here, no network) or plain; a first JSON line with the rows
  // less their turns, then one line of turns per row, parsed when the row is shown or searched.
  const node = document.getElementById("viewer-data");
  let text = node.textContent;
  if (node.dataset.encoding === "gzip+base64") {
    if (typeof DecompressionStream === "undefined") {
      throw new Error("this browser cannot inflate the page's data (no DecompressionStream); " +
                      "rebuild the page with: python -m scripts.viewer ... --no-compress");
    }
    const bin = atob(text);
    const bytes = new Uint8Array(bin.length);
    for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
    text = await new Response(new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"))).text();
  }
  node.textContent = "";
  const first = text.indexOf("\n");
  const D = JSON.parse(first < 0 ? text : text.slice(0, first));
  const n = D.rows.length + (D.n_observations || 0);   // rows' turns, then distinct observations
  const starts = new Float64Array(n + 1);
  let pos = first + 1;
  for (let i = 0; i < n; i++) {
    starts[i] = pos;
    const nl = text.indexOf("\n", pos);
    pos = nl < 0 ? text.length + 1 : nl + 1;
  }
  starts[n] = pos;
  const cache = new Array(n);
  const line = (i) => {
    if (cache[i] === undefined) cache[i] = JSON.parse(text.slice(starts[i], starts[i + 1] - 1));
    return cache[i];
  };
  const rows = D.rows.length;
  D.turnsOf = (i) => {
    const turns = line(i);
    for (const t of turns) {
      if (t.policy === undefined) t.policy = Array.isArray(t.tokens) ? t.tokens.join("") : "";
      if (t.observation === undefined) t.observation = typeof t.obs === "number" ? line(rows + t.obs) : "";
    }
    return turns;
  };
  return D;
}

function fail(err) {
  console.error("viewer:", err);
  const box = document.getElementById("detail");
  box.replaceChildren();
  const p = document.createElement("p");
  p.className = "bad";
  p.textContent = `The page could not be drawn: ${err && err.message ? err.message : err}`;
  box.append(p);
}

loadData().then(main).catch(fail);

function main(D) {
  const ROWS = D.rows;
  const ROW_H = 26;
  const COLOURS = ["#3b6fd8", "#d8663b", "#13795b", "#8a3bd8", "#b4a418", "#d83b8a"];
  const $ = (id) => document.getElementById(id);

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") node.className = v;
      else if (k === "style") node.style.cssText = v;
      else if (k.startsWith("data-")) node.setAttribute(k, v);
      else node[k] = v;
    }
    for (const c of children) {
      if (c === null || c === undefined) continue;
      node.append(c instanceof Node ? c : String(c));
    }
    return node;
  }
  const fmt = (v, d = 3) => (v === null || v === undefined || Number.isNaN(v) ? "–" : (+v).toFixed(d).replace(/\.?0+$/, "") || "0");
  const reward = (r) => (r.reward ?? r.score ?? 0);
  const mean = (xs) => (xs.length ? xs.reduce((a, b) => a + b, 0) / xs.length : NaN);

  // ---- derived per row ------------------------------------------------------------------
  const questions = D.prompts.map((p) => {
    const at = p.lastIndexOf("Question:");
    const q = (at >= 0 ? p.slice(at + 9) : p.slice(-160)).trim();
    return q.split("\n")[0].slice(0, 200);
  });
  const byPrompt = new Map();
  ROWS.forEach((r, i) => {
    r._i = i;
    r._r = reward(r);
    r._n = r.n_searches ?? 0;
    r._stop = r.stop_reason ?? "";
    r._src = r.data_source ?? "";
    if (!byPrompt.has(r.prompt)) byPrompt.set(r.prompt, []);
    byPrompt.get(r.prompt).push(i);
  });
  const haystacks = new Array(ROWS.length);
  function haystack(r) {
    if (haystacks[r._i] === undefined) {
      const parts = [D.prompts[r.prompt]];
      for (const t of D.turnsOf(r._i)) {
        parts.push(t.policy || "", t.observation || "", ...(t.queries || []));
      }
      haystacks[r._i] = parts.join("\n").toLowerCase();
    }
    return haystacks[r._i];
  }
  let advScale = 0;
  for (const r of ROWS) advScale = Math.max(advScale, Math.abs(r.adv_max ?? r.advantage ?? 0) || 0);
  advScale = advScale || 1;

  // ---- filters --------------------------------------------------------------------------
  const distinct = (f) => [...new Set(ROWS.map(f))].sort((a, b) => (a < b ? -1 : a > b ? 1 : 0));
  function options(select, values, label) {
    select.replaceChildren(el("option", { value: "" }, "any"));
    for (const v of values) select.append(el("option", { value: String(v) }, label ? label(v) : String(v)));
  }
  options($("f-set"), D.sets.map((_, i) => i), (i) => D.sets[i]);
  options($("f-source"), distinct((r) => r._src));
  options($("f-searches"), distinct((r) => r._n));
  options($("f-stop"), distinct((r) => r._stop));
  function refreshSteps() {
    const set = $("f-set").value;
    const keep = $("f-step").value;
    const steps = distinct((r) => (set === "" || String(r.set) === set ? r.step : null)).filter((s) => s !== null);
    options($("f-step"), steps);
    $("f-step").value = steps.map(String).includes(keep) ? keep : "";
  }
  refreshSteps();

  function readFilters() {
    const num = (id) => ($(id).value === "" ? null : Number($(id).value));
    return {
      set: $("f-set").value, step: $("f-step").value, source: $("f-source").value,
      min: num("f-min-reward"), max: num("f-max-reward"), correct: $("f-correct").value,
      searches: $("f-searches").value, stop: $("f-stop").value, text: $("f-text").value.trim().toLowerCase(),
    };
  }
  let visible = [];
  let selected = -1;
  function applyFilters() {
    const f = readFilters();
    visible = [];
    for (const r of ROWS) {
      if (f.set !== "" && String(r.set) !== f.set) continue;
      if (f.step !== "" && String(r.step) !== f.step) continue;
      if (f.source !== "" && r._src !== f.source) continue;
      if (f.min !== null && !(r._r >= f.min)) continue;
      if (f.max !== null && !(r._r <= f.max)) continue;
      if (f.correct !== "" && (r.correct ? "1" : "0") !== f.correct) continue;
      if (f.searches !== "" && String(r._n) !== f.searches) continue;
      if (f.stop !== "" && r._stop !== f.stop) continue;
      if (f.text && !haystack(r).includes(f.text)) continue;
      visible.push(r._i);
    }
    const count = $("count");
    count.textContent = `${visible.length.toLocaleString()} of ${ROWS.length.toLocaleString()} trajectories`;
    count.dataset.shown = String(visible.length);
    count.dataset.total = String(ROWS.length);
    $("list-spacer").style.height = `${visible.length * ROW_H}px`;
    $("list-body").scrollTop = 0;
    renderList(true);
    markSteps();
  }
  let timer = null;
  const later = () => { clearTimeout(timer); timer = setTimeout(applyFilters, 120); };
  for (const id of ["f-min-reward", "f-max-reward", "f-text"]) $(id).addEventListener("input", later);
  for (const id of ["f-source", "f-correct", "f-searches", "f-stop", "f-step"]) $(id).addEventListener("change", applyFilters);
  $("f-set").addEventListener("change", () => { refreshSteps(); applyFilters(); });
  $("f-colour").addEventListener("change", () => { if (selected >= 0) showDetail(selected); });

  // ---- the list (only the rows in view are in the DOM) -----------------------------------
  const head = $("list-head");
  for (const name of ["step", "set", "source", "reward", "ok", "srch", "len", "stop", "question"]) head.append(el("span", {}, name));
  const body = $("list-body");
  let drawn = "";
  function renderList(force) {
    const top = body.scrollTop;
    const first = Math.max(0, Math.floor(top / ROW_H) - 10);
    const last = Math.min(visible.length, Math.ceil((top + body.clientHeight) / ROW_H) + 10);
    const key = `${first}:${last}:${selected}`;
    if (!force && key === drawn) return;
    drawn = key;
    const nodes = [$("list-spacer")];
    for (let k = first; k < last; k++) {
      const r = ROWS[visible[k]];
      const ok = r.correct ? el("span", { class: "ok" }, "✓") : el("span", { class: "bad" }, "✗");
      const row = el("div", { class: "row" + (r._i === selected ? " selected" : ""), "data-i": String(r._i),
                              style: `top:${k * ROW_H}px` },
        el("span", {}, r.step), el("span", { title: D.sets[r.set] }, D.sets[r.set]), el("span", { title: r._src }, r._src),
        el("span", {}, fmt(r._r)), ok, el("span", {}, r._n), el("span", {}, r.response_length ?? ""),
        el("span", { title: r._stop }, r._stop), el("span", { title: questions[r.prompt] }, questions[r.prompt]));
      nodes.push(row);
    }
    body.replaceChildren(...nodes);
  }
  body.addEventListener("scroll", () => requestAnimationFrame(() => renderList(false)));
  body.addEventListener("click", (ev) => {
    const row = ev.target.closest(".row");
    if (row) showDetail(Number(row.dataset.i));
  });
  $("list").addEventListener("keydown", (ev) => {
    if (ev.key !== "ArrowDown" && ev.key !== "ArrowUp") return;
    const at = visible.indexOf(selected);
    const next = visible[Math.max(0, Math.min(visible.length - 1, at + (ev.key === "ArrowDown" ? 1 : -1)))];
    if (next !== undefined) {
      showDetail(next);
      const y = visible.indexOf(next) * ROW_H;
      if (y < body.scrollTop || y > body.scrollTop + body.clientHeight - ROW_H) body.scrollTop = y - body.clientHeight / 2;
      ev.preventDefault();
    }
  });

  // ---- steps: table and charts -----------------------------------------------------------
  const stepStats = new Map();   // "set:step" -> stats
  for (const r of ROWS) {
    const key = `${r.set}:${r.step}`;
    if (!stepStats.has(key)) stepStats.set(key, { set: r.set, step: r.step, rewards: [], correct: [], len: [], srch: [] });
    const s = stepStats.get(key);
    s.rewards.push(r._r); s.correct.push(r.correct ? 1 : 0); s.len.push(r.response_length ?? 0); s.srch.push(r._n);
  }
  const steps = [...stepStats.values()].sort((a, b) => a.set - b.set || a.step - b.step);
  for (const s of steps) {
    s.n = s.rewards.length; s.reward = mean(s.rewards); s.acc = mean(s.correct); s.length = mean(s.len); s.searches = mean(s.srch);
  }
  function pickStep(set, step) {
    $("f-set").value = String(set);
    refreshSteps();
    $("f-step").value = String(step);
    applyFilters();
  }
  const table = el("table", {}, el("tr", {}, ...["set", "step", "n", "reward", "correct", "length", "searches"].map((h) => el("th", {}, h))));
  for (const s of steps) {
    const tr = el("tr", { class: "step", "data-set": String(s.set), "data-step": String(s.step) },
      el("td", {}, D.sets[s.set]), el("td", {}, s.step), el("td", {}, s.n), el("td", {}, fmt(s.reward)),
      el("td", {}, fmt(s.acc)), el("td", {}, fmt(s.length, 1)), el("td", {}, fmt(s.searches, 2)));
    tr.addEventListener("click", () => pickStep(s.set, s.step));
    table.append(tr);
  }
  $("steps").append(table);
  function markSteps() {
    const f = readFilters();
    for (const tr of $("steps").querySelectorAll("tr.step")) {
      tr.classList.toggle("selected", tr.dataset.set === f.set && tr.dataset.step === f.step);
    }
  }

  const SVG = "http://www.w3.org/2000/svg";
  function svg(tag, attrs) {
    const node = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
    return node;
  }
  function chart(title, field) {
    const W = 200, H = 84, P = 16;
    const pts = steps.filter((s) => Number.isFinite(s[field]));
    const box = el("div", { class: "chart" }, el("div", { class: "title" }, title));
    const g = svg("svg", { width: W, height: H, viewBox: `0 0 ${W} ${H}` });
    if (pts.length) {
      const xs = pts.map((s) => s.step), ys = pts.map((s) => s[field]);
      const x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(...ys), y1 = Math.max(...ys);
      const X = (x) => P + (x1 === x0 ? (W - 2 * P) / 2 : ((x - x0) / (x1 - x0)) * (W - 2 * P));
      const Y = (y) => H - P - (y1 === y0 ? (H - 2 * P) / 2 : ((y - y0) / (y1 - y0)) * (H - 2 * P));
      D.sets.forEach((name, set) => {
        const mine = pts.filter((s) => s.set === set);
        if (!mine.length) return;
        const colour = COLOURS[set % COLOURS.length];
        g.append(svg("polyline", { points: mine.map((s) => `${X(s.step)},${Y(s[field])}`).join(" "), fill: "none", stroke: colour, "stroke-width": 1.5 }));
        for (const s of mine) {
          const c = svg("circle", { cx: X(s.step), cy: Y(s[field]), r: 3, fill: colour });
          const tip = svg("title", {});
          tip.textContent = `${name} step ${s.step}: ${fmt(s[field])}`;
          c.append(tip);
          c.addEventListener("click", () => pickStep(s.set, s.step));
          g.append(c);
        }
      });
      const label = (x, y, text, anchor) => { const t = svg("text", { x, y, "font-size": 9, fill: "#7a8595", "text-anchor": anchor }); t.textContent = text; g.append(t); };
      label(2, P - 4, fmt(y1, 2), "start");
      label(2, H - 2, fmt(y0, 2), "start");
      label(W - 2, H - 2, `step ${x1}`, "end");
    }
    box.append(g);
    return box;
  }
  const legend = el("div", { class: "chart" }, el("div", { class: "title" }, "sets"));
  D.sets.forEach((name, set) => legend.append(el("div", {}, el("span", { class: "sw", style: `display:inline-block;width:10px;height:10px;background:${COLOURS[set % COLOURS.length]}` }), " ", name)));
  $("charts").append(chart("mean reward", "reward"), chart("correct", "acc"), chart("response length (tokens)", "length"),
                     chart("searches per trajectory", "searches"), legend);
  $("summary").textContent = `${ROWS.length.toLocaleString()} trajectories · ${steps.length} step files · ${D.sets.join(", ")}`;

  // ---- one trajectory ----------------------------------------------------------------------
  function tint(value, mode) {
    if (value === null || value === undefined) return "";
    if (mode === "adv") {
      const a = Math.min(1, Math.abs(value) / advScale) * 0.55;
      return value >= 0 ? `rgba(19,150,91,${a.toFixed(3)})` : `rgba(210,40,30,${a.toFixed(3)})`;
    }
    if (mode === "lp") return `rgba(230,120,0,${(Math.min(1, -value / 4) * 0.6).toFixed(3)})`;
    return "";
  }
  function policyNode(turn, mode) {
    const pre = el("pre", { class: "policy" });
    const adv = turn.adv, lp = turn.lp;
    const at = (xs, k) => (Array.isArray(xs) ? xs[k] : xs);
    if (mode !== "none" && Array.isArray(turn.tokens) && turn.tokens.length) {
      turn.tokens.forEach((piece, k) => {
        const a = at(adv, k), l = Array.isArray(lp) ? lp[k] : null;
        const value = mode === "adv" ? a : l;
        const span = el("span", { class: "tok", title: `adv ${fmt(a)} · log-prob ${fmt(l)}` }, piece);
        const bg = tint(value, mode);
        if (bg) span.style.background = bg;
        pre.append(span);
      });
    } else {
      const span = el("span", { class: "tok" }, turn.policy || "");
      const value = mode === "adv" ? (Array.isArray(adv) ? mean(adv) : adv) : (Array.isArray(lp) ? mean(lp) : null);
      const bg = mode === "none" ? "" : tint(value, mode);
      if (bg) span.style.background = bg;
      pre.append(span);
    }
    return pre;
  }
  function turnNode(turn, k, mode) {
    const bits = [`turn ${k + 1}`];
    if (turn.action) bits.push(turn.action);
    if (turn.policy_tokens !== undefined) bits.push(`${turn.policy_tokens} policy tokens, ${turn.trained ?? "?"} trained`);
    const node = el("div", { class: "turn" }, el("div", { class: "label" }, bits.join(" · ")), policyNode(turn, mode));
    const asked = el("div", {});
    for (const q of turn.queries || []) asked.append(el("span", { class: "chip query", title: "query sent to the retriever" }, "query: ", q));
    for (const c of turn.calls || []) asked.append(el("span", { class: "chip" }, "call ", c || "(unreadable)"));
    if (turn.opened) asked.append(el("span", { class: "chip query" }, "open ", turn.opened));
    if (asked.childNodes.length) node.append(asked);
    if (turn.observation) {
      const docs = (turn.doc_ids || []).flat();
      node.append(el("div", { class: "obs-label" }, `observation · not trained${turn.obs_tokens !== undefined ? ` · ${turn.obs_tokens} tokens` : ""}`,
                     docs.length ? " · docs " : "", ...docs.map((d) => el("span", { class: "chip" }, d))));
      node.append(el("pre", { class: "obs", title: "observation: context, not trained on" }, turn.observation));
    }
    return node;
  }
  function partsTable(r) {
    const parts = Object.assign({}, r.reward_parts || {});
    const table = el("table", { class: "parts" });
    for (const [k, v] of Object.entries(parts)) table.append(el("tr", {}, el("td", {}, k), el("td", {}, typeof v === "object" ? JSON.stringify(v) : String(v))));
    return Object.keys(parts).length ? table : null;
  }
  function trajectoryNode(r, mode) {
    const box = el("div", { class: "traj", "data-i": String(r._i) });
    box.append(el("h3", {}, `${D.sets[r.set]} · step ${r.step} · ${r._src || "?"}`, r.correct ? el("span", { class: "ok" }, "  ✓ correct") : el("span", { class: "bad" }, "  ✗ wrong")));
    const meta = el("div", { class: "meta" });
    const pairs = [["reward", fmt(r.reward)], ["score", fmt(r.score)], ["advantage", fmt(r.advantage)],
      ["trained tokens", r.trained_tokens], ["length", r.response_length], ["searches", r._n], ["stop", r._stop],
      ["gold", r.gts === undefined ? undefined : JSON.stringify(r.gts)], ["uid", r.uid]];
    for (const [k, v] of pairs) if (v !== undefined && v !== null && v !== "") meta.append(el("span", {}, `${k} `, el("b", {}, v)));
    box.append(meta, partsTable(r));
    box.append(el("details", { class: "prompt" }, el("summary", {}, "prompt: ", questions[r.prompt]), el("pre", {}, D.prompts[r.prompt])));
    D.turnsOf(r._i).forEach((t, k) => box.append(turnNode(t, k, mode)));
    return box;
  }
  function legendNode(mode) {
    if (mode === "adv") {
      return el("div", { class: "legend" }, "policy tokens by advantage:", el("span", { class: "sw", style: `background:${tint(-advScale, "adv")}` }), `−${fmt(advScale, 2)}`,
        el("span", { class: "sw", style: `background:${tint(advScale, "adv")}` }), `+${fmt(advScale, 2)}`, " · grey dashed: observation, not trained");
    }
    if (mode === "lp") return el("div", { class: "legend" }, "policy tokens by log-prob (darker = less likely) · grey dashed: observation, not trained");
    return el("div", { class: "legend" }, "grey dashed: observation, not trained");
  }
  let compareWith = "";
  function showDetail(i) {
    selected = i;
    const r = ROWS[i];
    const mode = $("f-colour").value;
    const detail = $("detail");
    const others = new Map();
    for (const j of byPrompt.get(r.prompt)) {
      const o = ROWS[j];
      const key = `${o.set}:${o.step}`;
      if (!(o.set === r.set && o.step === r.step)) others.set(key, o);
    }
    const select = el("select", { id: "compare" }, el("option", { value: "" }, "—"));
    for (const [key, o] of [...others.entries()].sort((a, b) => a[1].set - b[1].set || a[1].step - b[1].step)) {
      select.append(el("option", { value: key }, `${D.sets[o.set]} step ${o.step}`));
    }
    if (!others.has(compareWith)) compareWith = "";
    select.value = compareWith;
    select.addEventListener("change", () => { compareWith = select.value; showDetail(i); });
    const bar = el("div", { class: "compare-bar" }, "same prompt at another step: ", select,
      others.size ? ` (${others.size} other step${others.size > 1 ? "s" : ""})` : " (none)");
    const left = el("div", { class: "col" }, trajectoryNode(r, mode));
    const cols = el("div", { class: "columns" + (compareWith ? " two" : "") }, left);
    if (compareWith) {
      const [set, step] = compareWith.split(":").map(Number);
      const right = el("div", { class: "col" });
      for (const j of byPrompt.get(r.prompt)) {
        const o = ROWS[j];
        if (o.set === set && o.step === step) right.append(trajectoryNode(o, mode));
      }
      cols.append(right);
    }
    detail.replaceChildren(bar, legendNode(mode), cols);
    detail.scrollTop = 0;
    renderList(true);
  }

  applyFilters();
  if (visible.length) showDetail(visible[0]);
  window.viewerReady = performance.now();
  document.body.dataset.ready = "1";
  // Parse the turns for the text filter in the background, a slice at a time, so the page stays
  // responsive and a first search does not wait for all of them.
  let next = 0;
  (function warm() {
    const end = Math.min(ROWS.length, next + 200);
    for (; next < end; next++) haystack(ROWS[next]);
    if (next < ROWS.length) setTimeout(warm, 0);
    else window.viewerWarm = performance.now();
  })();
}
