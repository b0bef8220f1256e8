// branchgym view: draws the trees the page embeds (branchgym/viewer.py writes the data).
// Vanilla JS and SVG, no dependencies: the page must open offline, from disk.
(function () {
  "use strict";

  const SVGNS = "http://www.w3.org/2000/svg";
  const DX = 132; // pixels per decision step
  const DY = 34; // pixels per leaf row
  const R = 7; // node radius
  const TEXT_PREVIEW = 3000; // characters of an action/observation shown before "show all"
  const LABEL_CHARS = 18;
  const BADGE_CHARS = 24; // a branch point's badge ends before the next column's labels

  const $ = (sel) => document.querySelector(sel);
  const index = JSON.parse($("#bg-index").textContent);
  const parsed = new Map(); // step index -> parsed step data (each parsed on first view)
  const state = { step: index.step_labels.length - 1, tree: 0, selected: null, view: null };
  const curves = index.default_curves.slice();

  function stepData(i) {
    if (!parsed.has(i)) {
      parsed.set(i, JSON.parse(document.getElementById("bg-step-" + i).textContent));
    }
    return parsed.get(i);
  }

  // ------------------------------------------------------------------ formatting
  function fmt(x, digits) {
    if (x === null || x === undefined) return "–";
    if (typeof x !== "number") return String(x);
    const d = digits === undefined ? 3 : digits;
    if (x !== 0 && (Math.abs(x) >= 1e5 || Math.abs(x) < Math.pow(10, -d))) return x.toExponential(2);
    let s = x.toFixed(d);
    if (s.includes(".")) s = s.replace(/0+$/, "").replace(/\.$/, "");
    return s === "-0" ? "0" : s;
  }
  function signed(x) {
    if (x === null || x === undefined) return "–";
    return (x > 0 ? "+" : "") + fmt(x);
  }
  function short(text, n) {
    const one = String(text).replace(/\s+/g, " ").trim();
    return one.length > n ? one.slice(0, n - 1) + "…" : one;
  }
  function el(tag, attrs, text) {
    const e = document.createElement(tag);
    for (const k in attrs || {}) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    return e;
  }
  function sv(tag, attrs, text) {
    const e = document.createElementNS(SVGNS, tag);
    for (const k in attrs || {}) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    return e;
  }

  // ------------------------------------------------------------------ colour scale
  // ColorBrewer RdBu: negative advantage red, zero near white, positive blue.
  const STOPS = ["#b2182b", "#ef8a62", "#fddbc7", "#f7f7f7", "#d1e5f0", "#67a9cf", "#2166ac"]
    .map((h) => [1, 3, 5].map((i) => parseInt(h.slice(i, i + 2), 16)));
  function colour(a, scale) {
    const t = Math.max(-1, Math.min(1, a / scale)); // -1 .. 1
    const x = ((t + 1) / 2) * (STOPS.length - 1);
    const i = Math.min(STOPS.length - 2, Math.floor(x));
    const f = x - i;
    const c = STOPS[i].map((v, j) => Math.round(v + (STOPS[i + 1][j] - v) * f));
    return "rgb(" + c.join(",") + ")";
  }
  function advScale(step) {
    let m = 0;
    for (const t of step.trees) for (const n of t.nodes) if (n.advantage !== null) m = Math.max(m, Math.abs(n.advantage));
    return m > 0 ? m : 1;
  }

  // ------------------------------------------------------------------ layout
  // x by depth; y: each leaf its own row, in depth-first order with k = 1 first, and a
  // node on the row of its first child, so every main line (the backbone on top) is straight.
  function layout(tree) {
    const kids = new Map([[-1, []]]);
    for (const n of tree.nodes) kids.set(n.id, []);
    for (const n of tree.nodes) kids.get(n.parent).push(n.id);
    // pre-order (children by k): leaves take rows top down; in reverse, every parent
    // comes after its children and takes its first child's row
    const pre = [];
    const stack = [-1];
    while (stack.length) {
      const id = stack.pop();
      pre.push(id);
      const c = kids.get(id);
      for (let i = c.length - 1; i >= 0; i--) stack.push(c[i]);
    }
    const rows = new Map();
    let row = 0;
    for (const id of pre) if (kids.get(id).length === 0) rows.set(id, row++);
    for (let i = pre.length - 1; i >= 0; i--) {
      const id = pre[i];
      if (!rows.has(id)) rows.set(id, rows.get(kids.get(id)[0]));
    }
    const pos = new Map();
    const byId = new Map(tree.nodes.map((n) => [n.id, n]));
    pos.set(-1, { x: 0, y: rows.get(-1) * DY });
    for (const n of tree.nodes) pos.set(n.id, { x: (n.step + 1) * DX, y: rows.get(n.id) * DY });
    const depth = tree.nodes.reduce((m, n) => Math.max(m, n.step + 1), 0);
    return { kids, pos, byId, rows: Math.max(row, 1), depth };
  }

  // ------------------------------------------------------------------ drawing
  let current = null; // {step, tree, lay, scale}

  function drawTree() {
    const t0 = performance.now();
    const step = stepData(state.step);
    const tree = step.trees[state.tree];
    const lay = layout(tree);
    const scale = advScale(step);
    current = { step, tree, lay, scale };
    $("#legend-min").textContent = signed(-scale);
    $("#legend-max").textContent = signed(scale);
    const edges = $("#edges"), nodes = $("#nodes"), bps = $("#bps");
    edges.replaceChildren();
    nodes.replaceChildren();
    bps.replaceChildren();
    const fe = document.createDocumentFragment(), fn = document.createDocumentFragment();
    const fb = document.createDocumentFragment();

    // the reset state
    const root = sv("g", { class: "node root", "data-root": "1", tabindex: "-1" });
    root.appendChild(sv("rect", { x: -R, y: -R, width: 2 * R, height: 2 * R, rx: 2 }));
    root.appendChild(sv("title", {}, "reset state (seed " + tree.seed + ")"));
    root.appendChild(sv("text", { class: "label", x: -R, y: -R - 5 }, "reset"));
    root.setAttribute("transform", "translate(0," + lay.pos.get(-1).y + ")");
    root.addEventListener("click", (e) => { e.stopPropagation(); select(-1); });
    fn.appendChild(root);

    for (const n of tree.nodes) {
      const p = lay.pos.get(n.parent), q = lay.pos.get(n.id);
      const xm = (p.x + q.x) / 2;
      const cls = "edge" + (n.backbone ? " backbone" : "") + (n.error ? " to-error" : "");
      fe.appendChild(sv("path", {
        class: cls, "data-edge": n.parent + "-" + n.id,
        d: "M" + p.x + "," + p.y + " C" + xm + "," + p.y + " " + xm + "," + q.y + " " + q.x + "," + q.y,
      }));
      const g = sv("g", {
        class: "node" + (n.backbone ? " backbone" : "") + (n.error ? " error" : ""),
        "data-node-id": n.id, "data-step": n.step, "data-k": n.k,
        "data-backbone": n.backbone ? "1" : "0",
        "data-advantage": n.advantage === null ? "" : n.advantage,
        transform: "translate(" + q.x + "," + q.y + ")",
      });
      if (n.error) {
        g.setAttribute("data-error", n.error);
        g.appendChild(sv("rect", { class: "error-mark", x: -R, y: -R, width: 2 * R, height: 2 * R, rx: 2 }));
        g.appendChild(sv("path", { class: "error-x", d: "M-3.5,-3.5 L3.5,3.5 M3.5,-3.5 L-3.5,3.5" }));
        g.appendChild(sv("text", { class: "label err", x: R + 6, y: 4 }, short(n.error, 64)));
      } else {
        const c = sv("circle", { r: R });
        if (n.advantage === null) c.setAttribute("class", "no-adv");
        else c.setAttribute("fill", colour(n.advantage, scale));
        g.appendChild(c);
        g.appendChild(sv("text", { class: "label", x: -R, y: -R - 5 }, short(n.action, LABEL_CHARS)));
        if (n.leaf) g.appendChild(sv("text", { class: "label ret", x: R + 6, y: 4 }, "G " + fmt(n.return, 2)));
        if (n.invalid) {
          g.setAttribute("data-invalid", "1");
          g.appendChild(sv("circle", { class: "invalid-mark", cx: R * 0.8, cy: -R * 0.8, r: 3 }));
        }
      }
      g.appendChild(sv("title", {}, "step " + n.step + (n.k ? " · k=" + n.k : "") + " · A " + signed(n.advantage) + "\n" + short(n.action, 200)));
      g.addEventListener("click", (e) => { e.stopPropagation(); select(n.id); });
      fn.appendChild(g);
    }

    tree.branch_points.forEach((b, i) => {
      const p = lay.pos.get(b.parent);
      // as many sibling returns as fit before the next column (all of them in the panel)
      const returns = b.returns.map((r, j) => (b.valid[j] ? fmt(r, 2) : "✕"));
      let text = "K=" + b.k + "  G " + returns[0];
      for (let j = 1; j < returns.length; j++) {
        if (text.length + returns[j].length + 3 > BADGE_CHARS) { text += " …"; break; }
        text += " · " + returns[j];
      }
      const w = 10 + text.length * 5.6;
      const g = sv("g", {
        class: "bp" + (b.degenerate ? " degenerate" : ""), "data-bp": i,
        "data-bp-degenerate": b.degenerate ? "1" : "0", "data-bp-k": b.k, "data-bp-step": b.step, "data-bp-parent": b.parent,
        "data-bp-returns": JSON.stringify(b.returns),
        transform: "translate(" + (p.x - 20) + "," + (p.y + 10) + ")", // under the fork, clear of the next column
      });
      g.appendChild(sv("rect", { class: "bp-badge", x: 0, y: 0, width: w, height: 15, rx: 7.5 }));
      g.appendChild(sv("text", { class: "label bp", x: 6, y: 11 }, text));
      g.appendChild(sv("title", {}, "branch point at step " + b.step + ": K = " + b.k + " siblings, returns " + b.returns.map((r) => fmt(r)).join(", ") +
        (b.degenerate ? "\ndegenerate: every sibling that ran returned the same, so no advantage" : "")));
      g.addEventListener("click", (e) => { e.stopPropagation(); selectBranchPoint(i); });
      fb.appendChild(g);
    });
    edges.appendChild(fe);
    bps.appendChild(fb);
    nodes.appendChild(fn);
    fit();
    summary(tree, step);
    const ms = performance.now() - t0;
    document.body.dataset.renderMs = ms.toFixed(1);
    document.body.dataset.nodes = String(tree.nodes.length);
    requestAnimationFrame(() => requestAnimationFrame(() => {
      document.body.dataset.paintMs = (performance.now() - t0).toFixed(1);
      document.body.dataset.ready = "1";
    }));
  }

  function summary(tree, step) {
    const s = $("#summary");
    s.replaceChildren();
    const bit = (label, value) => {
      s.appendChild(document.createTextNode(label + " "));
      s.appendChild(el("b", {}, value));
      s.appendChild(document.createTextNode("   "));
    };
    bit("env", tree.env_id);
    bit("seed", String(tree.seed));
    bit("decisions", String(tree.nodes.length));
    bit("rollouts", String(tree.rollouts));
    bit("branch points", String(tree.branch_points.length));
    bit("errors", String(tree.errors));
    bit("mean return", fmt(tree.mean_return));
    bit("tokens saved", tree.stats["tokens saved"] === null ? "–" : (100 * tree.stats["tokens saved"]).toFixed(1) + " %");
    bit("snapshot/restore ms", fmt(tree.stats["snapshot ms"], 2) + " / " + fmt(tree.stats["restore ms"], 2));
    if (step.meta && step.meta.algo) bit("algo", step.meta.algo);
    if (tree.attribution) valueCurve(s, tree.attribution);
  }

  // V(s_t) along an attributed episode: points with their intervals, decisive step red
  function valueCurve(parent, att) {
    const vals = att.values.filter((v) => v[1] !== null);
    if (!vals.length) return;
    const W = 360, H = 110, L = 34, B = 22, T = 8, R = 10;
    const last = Math.max(1, vals[vals.length - 1][0]);
    const x = (t) => L + (W - L - R) * t / last, y = (v) => T + (H - T - B) * (1 - v);
    const g = sv("svg", { width: W, height: H, class: "value-curve", role: "img",
      "aria-label": "value along the episode" });
    if (att.decisive !== null) {
      g.appendChild(sv("rect", { x: x(att.decisive), y: T, width: x(att.decisive + 1) - x(att.decisive),
        height: H - T - B, class: "decisive-band" }));
    }
    for (const v of [0, 0.5, 1]) {
      g.appendChild(sv("line", { x1: L, x2: W - R, y1: y(v), y2: y(v), class: "vc-grid" }));
      g.appendChild(sv("text", { x: L - 4, y: y(v) + 3, class: "vc-label", "text-anchor": "end" }, v.toFixed(1)));
    }
    for (const v of vals) {
      g.appendChild(sv("line", { x1: x(v[0]), x2: x(v[0]), y1: y(v[2]), y2: y(v[3]), class: "vc-ci" }));
    }
    g.appendChild(sv("polyline", { points: vals.map((v) => x(v[0]) + "," + y(v[1])).join(" "),
      class: "vc-line" }));
    for (const v of vals) {
      g.appendChild(sv("circle", { cx: x(v[0]), cy: y(v[1]), r: 3.2, class: v[4] ? "vc-point" : "vc-outcome" },
        undefined)).appendChild(sv("title", {}, "step " + v[0] + ": V " + fmt(v[1]) +
          (v[4] ? " [" + fmt(v[2]) + ", " + fmt(v[3]) + "] from " + v[4] + " forks" : " (the outcome)")));
    }
    g.appendChild(sv("text", { x: (L + W - R) / 2, y: H - 4, class: "vc-label", "text-anchor": "middle" },
      "step t: V(s_t), the chance of success from there"));
    const box = el("div", { class: "value-box" });
    box.appendChild(g);
    box.appendChild(el("p", { class: "value-statement" }, att.statement));
    parent.appendChild(box);
  }

  // ------------------------------------------------------------------ pan and zoom
  const svg = $("#tree");
  function applyView() {
    const v = state.view;
    svg.setAttribute("viewBox", v.x + " " + v.y + " " + v.w + " " + v.h);
    const pxPerUnit = svg.clientWidth / v.w;
    svg.classList.toggle("far", pxPerUnit < 0.55);
  }
  function fit() {
    const lay = current.lay;
    const w = Math.max(lay.depth * DX + 260, 400), h = Math.max(lay.rows * DY + 40, 120);
    const box = { x: -40, y: -36, w: w, h: h };
    // keep the screen's aspect so the drawing is not squeezed
    const ar = (svg.clientWidth || 800) / (svg.clientHeight || 500);
    if (box.w / box.h < ar) box.w = box.h * ar; else box.h = box.w / ar;
    // large trees: start readable at the top left rather than as a speck
    const minScale = 0.7; // screen px per unit: labels stay readable
    const sw = svg.clientWidth || 800;
    if (sw / box.w < minScale) { box.w = sw / minScale; box.h = box.w / ar; }
    state.view = box;
    applyView();
  }
  function zoom(factor, cx, cy) {
    const v = state.view;
    const px = cx === undefined ? v.x + v.w / 2 : cx, py = cy === undefined ? v.y + v.h / 2 : cy;
    v.x = px - (px - v.x) * factor;
    v.y = py - (py - v.y) * factor;
    v.w *= factor;
    v.h *= factor;
    applyView();
  }
  function toUnits(evt) {
    const r = svg.getBoundingClientRect(), v = state.view;
    return [v.x + ((evt.clientX - r.left) / r.width) * v.w, v.y + ((evt.clientY - r.top) / r.height) * v.h];
  }
  svg.addEventListener("wheel", (e) => {
    e.preventDefault();
    const [x, y] = toUnits(e);
    zoom(Math.exp(e.deltaY * 0.0015), x, y);
  }, { passive: false });
  let drag = null;
  svg.addEventListener("pointerdown", (e) => {
    if (e.button !== 0) return;
    drag = { x: e.clientX, y: e.clientY, vx: state.view.x, vy: state.view.y, moved: false };
  });
  window.addEventListener("pointermove", (e) => {
    if (!drag) return;
    const dx = e.clientX - drag.x, dy = e.clientY - drag.y;
    if (!drag.moved && Math.abs(dx) + Math.abs(dy) < 4) return;
    if (!drag.moved) svg.classList.add("panning");
    drag.moved = true;
    const k = state.view.w / svg.clientWidth;
    state.view.x = drag.vx - dx * k;
    state.view.y = drag.vy - dy * k;
    applyView();
  });
  window.addEventListener("pointerup", () => { drag = null; svg.classList.remove("panning"); });
  $("#zoom-in").addEventListener("click", () => zoom(1 / 1.3));
  $("#zoom-out").addEventListener("click", () => zoom(1.3));
  $("#zoom-fit").addEventListener("click", fit);
  $("#show-labels").addEventListener("change", (e) => svg.classList.toggle("no-labels", !e.target.checked));
  window.addEventListener("resize", () => state.view && applyView());

  function reveal(id) {
    const p = current.lay.pos.get(id), v = state.view;
    if (p.x < v.x + 20 || p.x > v.x + v.w - 60 || p.y < v.y + 20 || p.y > v.y + v.h - 20) {
      v.x = p.x - v.w / 3;
      v.y = p.y - v.h / 2;
      applyView();
    }
  }

  // ------------------------------------------------------------------ detail panel
  function textBlock(parent, field, text, extraClass) {
    const full = String(text);
    const pre = el("pre", { class: "text" + (extraClass ? " " + extraClass : ""), "data-field": field });
    parent.appendChild(pre);
    if (full.length <= TEXT_PREVIEW) {
      pre.textContent = full;
      return;
    }
    // long texts (SWE-bench outputs): a preview, the rest only on request
    pre.textContent = full.slice(0, TEXT_PREVIEW) + "…";
    pre.dataset.truncated = "1";
    const b = el("button", { class: "expand", "data-expand": field }, "show all " + full.length.toLocaleString("en") + " characters");
    b.addEventListener("click", () => {
      pre.textContent = full;
      pre.dataset.truncated = "0";
      b.remove();
    });
    parent.appendChild(b);
  }
  function figures(parent, rows) {
    const dl = el("dl", { class: "figures" });
    for (const [label, value, field] of rows) {
      dl.appendChild(el("dt", {}, label));
      const dd = el("dd", field ? { "data-field": field } : {});
      if (value instanceof Node) dd.appendChild(value); else dd.textContent = value;
      dl.appendChild(dd);
    }
    parent.appendChild(dl);
  }
  function sparkline(values) {
    const w = 380, h = 44, max = Math.max(...values, 1e-9);
    const s = sv("svg", { class: "spark", viewBox: "0 0 " + w + " " + h, preserveAspectRatio: "none", "data-field": "token-entropies" });
    const pts = values.map((v, i) => ((i + 0.5) * w / values.length).toFixed(1) + "," + (h - 3 - (v / max) * (h - 6)).toFixed(1));
    s.appendChild(sv("polyline", { points: pts.join(" ") }));
    s.appendChild(sv("title", {}, "per-token entropy, max " + fmt(max) + " nats"));
    return s;
  }
  function chip(a) {
    const c = el("span", { class: "adv-chip" });
    c.style.background = a === null ? "#fff" : colour(a, current.scale);
    return c;
  }

  function select(id) {
    state.selected = id;
    document.querySelectorAll(".node.selected, .bp.selected").forEach((e) => e.classList.remove("selected"));
    const d = $("#detail");
    d.replaceChildren();
    const tree = current.tree;
    if (id === -1) {
      document.querySelector("[data-root]").classList.add("selected");
      d.appendChild(el("h3", {}, "reset state"));
      d.dataset.node = "-1";
      figures(d, [["env", tree.env_id], ["seed", String(tree.seed)]]);
      d.appendChild(el("h4", {}, "observation"));
      textBlock(d, "observation", tree.observation);
      return;
    }
    const n = current.lay.byId.get(id);
    const g = document.querySelector('[data-node-id="' + id + '"]');
    if (g) g.classList.add("selected");
    reveal(id);
    d.dataset.node = String(id);
    d.appendChild(el("h3", { "data-field": "title" }, "decision " + n.id + " · step " + n.step + (n.k ? " · sibling k=" + n.k : "") + (n.backbone ? " · backbone" : "")));
    if (n.error) {
      d.appendChild(el("h4", {}, "error"));
      textBlock(d, "error", n.error, "error");
    }
    const adv = el("span", {});
    adv.appendChild(chip(n.advantage));
    adv.appendChild(document.createTextNode(signed(n.advantage)));
    figures(d, [
      ["advantage", adv, "advantage"],
      ["reward", fmt(n.reward), "reward"],
      ["return-to-go", fmt(n.return), "return"],
      ["tokens", n.tokens + (n.generated !== n.tokens ? " (" + n.generated + " generated)" : ""), "tokens"],
      ["entropy mean / max", fmt(n.entropy) + " / " + fmt(n.entropy_max) + " nats", "entropy"],
      ["log-prob (sum)", fmt(n.logprob), "logprob"],
      ["rollout", String(n.rollout), "rollout"],
      ["ended", n.done || "no", "done"],
      ["costs", Object.keys(n.costs).map((k) => k + " " + fmt(1000 * n.costs[k], 2) + " ms").join(", ") || "–", "costs"],
    ]);
    if (n.parse_error) {
      d.appendChild(el("h4", {}, "parse error"));
      textBlock(d, "parse_error", n.parse_error, "error");
    }
    d.appendChild(el("h4", {}, "action"));
    textBlock(d, "action", n.action);
    if (n.entropies.length > 1) {
      d.appendChild(el("h4", {}, "per-token entropy"));
      d.appendChild(sparkline(n.entropies));
    }
    d.appendChild(el("h4", {}, "observation"));
    textBlock(d, "observation", n.observation);
    if (n.info) {
      d.appendChild(el("h4", {}, "info"));
      textBlock(d, "info", n.info);
    }
  }

  function selectBranchPoint(i) {
    const b = current.tree.branch_points[i];
    document.querySelectorAll(".node.selected, .bp.selected").forEach((e) => e.classList.remove("selected"));
    document.querySelector('[data-bp="' + i + '"]').classList.add("selected");
    const d = $("#detail");
    d.replaceChildren();
    d.dataset.node = "";
    d.appendChild(el("h3", { "data-field": "title" }, "branch point at step " + b.step + " · K = " + b.k));
    figures(d, [
      ["K", String(b.k), "k"],
      ["forks after", b.parent === -1 ? "the reset state" : "decision " + b.parent, "parent"],
      ["schedule score", fmt(b.score), "score"],
      ["shared tokens", String(b.token_offset), "token_offset"],
      ["signal", b.degenerate ? "none: every sibling that ran returned the same" : "siblings differ", "degenerate"],
    ]);
    d.appendChild(el("h4", {}, "siblings"));
    const table = el("table", { class: "siblings", "data-field": "siblings" });
    const head = el("tr");
    ["k", "decision", "return G", "advantage", "action"].forEach((h) => head.appendChild(el("th", {}, h)));
    table.appendChild(head);
    b.siblings.forEach((sid, j) => {
      const n = current.lay.byId.get(sid);
      const tr = el("tr", { "data-sibling": sid });
      tr.appendChild(el("td", {}, String(j + 1)));
      tr.appendChild(el("td", {}, String(sid)));
      tr.appendChild(el("td", {}, b.valid[j] ? fmt(b.returns[j]) : "✕ error"));
      const a = el("td");
      a.appendChild(chip(n.advantage));
      a.appendChild(document.createTextNode(signed(n.advantage)));
      tr.appendChild(a);
      tr.appendChild(el("td", {}, n.error ? short(n.error, 40) : short(n.action, 40)));
      tr.addEventListener("click", () => select(sid));
      table.appendChild(tr);
    });
    d.appendChild(table);
  }

  // keyboard: left/right walk to the parent / first child, up/down through the siblings
  svg.setAttribute("tabindex", "0");
  document.addEventListener("keydown", (e) => {
    if (!current || e.target.tagName === "SELECT") return;
    if (e.key === "+" || e.key === "=") return zoom(1 / 1.3);
    if (e.key === "-") return zoom(1.3);
    if (e.key === "0") return fit();
    const id = state.selected;
    if (id === null) return;
    const lay = current.lay;
    const parent = id === -1 ? null : lay.byId.get(id).parent;
    let next = null;
    if (e.key === "ArrowRight") next = lay.kids.get(id)[0];
    else if (e.key === "ArrowLeft") next = parent;
    else if ((e.key === "ArrowDown" || e.key === "ArrowUp") && parent !== null) {
      const sib = lay.kids.get(parent), j = sib.indexOf(id) + (e.key === "ArrowDown" ? 1 : -1);
      next = sib[j];
    }
    if (next !== null && next !== undefined) {
      e.preventDefault();
      select(next);
    }
  });

  // ------------------------------------------------------------------ selectors
  function fillTrees() {
    const sel = $("#tree-select");
    sel.replaceChildren();
    stepData(state.step).trees.forEach((t, i) => {
      const label = "tree " + i + " · seed " + t.seed + " · " + t.nodes.length + " decisions · " + t.rollouts +
        " rollouts · mean G " + fmt(t.mean_return, 2) + (t.errors ? " · " + t.errors + " errors" : "");
      sel.appendChild(el("option", { value: i }, label));
    });
    state.tree = Math.min(state.tree, stepData(state.step).trees.length - 1);
    sel.value = String(state.tree);
  }
  function showStep(i) {
    state.step = i;
    $("#step-select").value = String(i);
    fillTrees();
    drawTree();
    const d = $("#detail");
    d.replaceChildren(el("p", { class: "placeholder" }, "Click a decision to see its action, observation and figures."));
    state.selected = null;
    drawCurves();
  }
  const stepSel = $("#step-select");
  index.step_labels.forEach((label, i) => stepSel.appendChild(el("option", { value: i }, label)));
  if (index.step_labels.length < 2) $("#step-control").hidden = true;
  stepSel.addEventListener("change", () => showStep(Number(stepSel.value)));
  $("#tree-select").addEventListener("change", (e) => {
    state.tree = Number(e.target.value);
    state.selected = null;
    drawTree();
  });

  // ------------------------------------------------------------------ learning curves
  function drawCurves() {
    const box = $("#curves");
    if (!index.metrics.length) return;
    box.hidden = false;
    const add = $("#curve-add");
    add.replaceChildren(el("option", { value: "" }, "metric…"));
    index.metric_keys.filter((k) => !curves.includes(k)).forEach((k) => add.appendChild(el("option", { value: k }, k)));
    const grid = $("#curve-grid");
    grid.replaceChildren();
    const now = index.step_numbers[state.step];
    for (const key of curves) {
      const pts = index.metrics.filter((m) => m[key] !== null && m[key] !== undefined).map((m) => [m.step, m[key]]);
      const card = el("div", { class: "curve", "data-curve": key });
      const head = el("div", { class: "curve-head" });
      head.appendChild(el("span", {}, key));
      const x = el("button", { title: "remove" }, "×");
      x.addEventListener("click", () => { curves.splice(curves.indexOf(key), 1); drawCurves(); });
      head.appendChild(x);
      card.appendChild(head);
      const W = 260, H = 110, L = 34, B = 16;
      const s = sv("svg", { viewBox: "0 0 " + W + " " + H });
      if (pts.length) {
        const xs = pts.map((p) => p[0]), ys = pts.map((p) => p[1]);
        let x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(...ys), y1 = Math.max(...ys);
        if (x1 === x0) { x0 -= 1; x1 += 1; }
        if (y1 === y0) { y0 -= 0.5; y1 += 0.5; }
        const X = (v) => L + ((v - x0) / (x1 - x0)) * (W - L - 6);
        const Y = (v) => 6 + (1 - (v - y0) / (y1 - y0)) * (H - B - 10);
        s.appendChild(sv("line", { class: "axis", x1: L, y1: H - B, x2: W - 4, y2: H - B }));
        s.appendChild(sv("line", { class: "axis", x1: L, y1: 4, x2: L, y2: H - B }));
        s.appendChild(sv("text", { x: 2, y: 12 }, fmt(y1, 2)));
        s.appendChild(sv("text", { x: 2, y: H - B }, fmt(y0, 2)));
        s.appendChild(sv("text", { x: L, y: H - 3 }, "step " + x0));
        s.appendChild(sv("text", { x: W - 40, y: H - 3 }, String(x1)));
        if (now !== null && now !== undefined) {
          s.appendChild(sv("line", { class: "now", x1: X(now), y1: 4, x2: X(now), y2: H - B }));
        }
        s.appendChild(sv("polyline", { class: "line", points: pts.map((p) => X(p[0]).toFixed(1) + "," + Y(p[1]).toFixed(1)).join(" ") }));
        if (pts.length <= 60) pts.forEach((p) => s.appendChild(sv("circle", { class: "dot", cx: X(p[0]), cy: Y(p[1]), r: 2 })));
        s.addEventListener("click", (e) => {
          const r = s.getBoundingClientRect();
          const stepAt = x0 + ((e.clientX - r.left) / r.width * W - L) / (W - L - 6) * (x1 - x0);
          let best = null;
          index.step_numbers.forEach((sn, i) => {
            if (sn !== null && (best === null || Math.abs(sn - stepAt) < Math.abs(index.step_numbers[best] - stepAt))) best = i;
          });
          if (best !== null && best !== state.step) showStep(best);
        });
      }
      card.appendChild(s);
      grid.appendChild(card);
    }
  }
  $("#curve-add").addEventListener("change", (e) => {
    if (e.target.value) { curves.push(e.target.value); drawCurves(); }
  });

  showStep(state.step);
})();
