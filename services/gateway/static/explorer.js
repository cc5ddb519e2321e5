"use strict";
// The explorer page: polls the gateway's /debug/explorer/* JSON and draws it. Every value
// goes into the DOM as text (textContent), never as markup.
(function () {
  const params = new URLSearchParams(location.search);
  const key = params.get("key") || sessionStorage.getItem("radixserve.key");
  if (params.get("key")) sessionStorage.setItem("radixserve.key", params.get("key"));
  const headers = key ? { Authorization: "Bearer " + key } : {};
  const POLL_MS = 2000;
  let treeWorker = params.get("worker") || "";
  let selectedNode = null;
  let lastTree = null;
  let lastRequests = [];

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") node.className = v;
      else node.setAttribute(k, v);
    }
    for (const child of children) {
      if (child === null || child === undefined) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }
  const svgEl = (tag, attrs) => {
    const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    return node;
  };
  const fmt = (v, digits) => (v === null || v === undefined ? "–" : typeof v === "number" && digits !== undefined ? v.toFixed(digits) : String(v));
  const pct = (v) => (v === null || v === undefined ? "–" : (100 * v).toFixed(1) + " %");
  const ago = (s) => (s ? Math.max(0, Date.now() / 1000 - s).toFixed(0) + " s ago" : "never");

  async function get(path) {
    const resp = await fetch(path, { headers });
    if (!resp.ok) {
      let message = resp.status + " " + resp.statusText;
      try { message = (await resp.json()).error.message; } catch (e) { /* not JSON */ }
      throw new Error(path.split("?")[0] + ": " + message);
    }
    return resp.json();
  }

  function setStatus(text, error) {
    const status = document.getElementById("status");
    status.textContent = text;
    status.className = error ? "error" : "";
  }

  // -- workers ---------------------------------------------------------------------------

  function pagesBar(device) {
    const total = device.pages_total || 1;
    const locked = device.pages_locked || 0;
    const evictable = device.pages_evictable || 0;
    const other = Math.max(0, (device.pages_used || 0) - locked - evictable);
    const bar = el("div", { class: "bar", title: "locked / evictable / other used pages" });
    let left = 0;
    for (const [cls, n] of [["locked", locked], ["evictable", evictable], ["other", other]]) {
      const w = (100 * n) / total;
      bar.append(el("span", { class: cls, style: `left:${left}%;width:${w}%` }));
      left += w;
    }
    return bar;
  }

  function tierRows(name, tier) {
    const rows = [];
    if (name === "device") {
      rows.push(["device pages", `${fmt(tier.pages_used)} used / ${fmt(tier.pages_total)} (locked ${fmt(tier.pages_locked)}, evictable ${fmt(tier.pages_evictable)})`]);
    } else {
      const parts = Object.entries(tier).map(([k, v]) => `${k.replace(/_/g, " ")} ${fmt(v)}`);
      rows.push([`${name} pages`, parts.join(", ")]);
    }
    return rows;
  }

  function workerCard(w) {
    const card = el("div", { class: "card", "data-worker": w.name, "data-role": w.role });
    card.append(el("h3", {}, w.name + " ", el("span", { class: "note" }, w.role),
      " ", el("span", { class: "state-" + w.state }, w.state)));
    const rows = w.tp_size ? [["TP size", w.tp_size]] : [];
    for (const [name, tier] of Object.entries(w.tiers)) rows.push(...tierRows(name, tier));
    if (w.hit_rate) rows.push(["hit rate (5 min)", `${pct(w.hit_rate.hit_rate)} of ${w.hit_rate.prompt_tokens} prompt tokens`]);
    for (const [k, v] of Object.entries(w.load)) rows.push([k.replace(/_/g, " "), v]);
    for (const [k, v] of Object.entries(w.audit)) rows.push([k.replace(/_/g, " "), v]);
    for (const [m, s] of Object.entries(w.speculation || {})) {
      rows.push([`speculation (${m})`, `${pct(s.acceptance)} of ${s.drafted} draft tokens kept, ${s.tokens_per_step.toFixed(1)} tokens a step`]);
    }
    for (const [name, fingerprint] of Object.entries(w.loras || {})) rows.push([`LoRA ${name}`, fingerprint.slice(0, 19)]);
    const dl = el("dl", { class: "kv" });
    for (const [k, v] of rows) dl.append(el("dt", {}, k), el("dd", {}, fmt(v)));
    if (w.tiers.device) card.append(pagesBar(w.tiers.device));
    card.append(dl);
    if (w.live) {
      const live = el("div", { class: "live" }, `in flight: ${w.live.count} `);
      for (const r of w.live.requests) live.append(el("span", { class: "phase", title: r.request_id }, r.phase));
      card.append(live);
    }
    return card;
  }

  async function refreshWorkers() {
    const data = await get("/debug/explorer/workers");
    const box = document.getElementById("workers");
    box.replaceChildren(...data.workers.map(workerCard));
    const rate = data.hit_rate;
    document.getElementById("cluster-hit").textContent = rate
      ? `cluster hit rate ${pct(rate.hit_rate)} (device ${rate.cached.device}, peer ${rate.cached.peer}, host ${rate.cached.host}, disk ${rate.cached.disk} of ${rate.prompt_tokens} prompt tokens, last 5 min)`
      : "no finished requests in the last 5 min";
    const select = document.getElementById("tree-worker");
    const names = data.workers.filter((w) => w.state !== "down" && w.role !== "kvstore").map((w) => w.name);
    if (!treeWorker || !names.includes(treeWorker)) treeWorker = names.find((n) => data.workers.find((w) => w.name === n).role === "decode") || names[0] || "";
    const current = Array.from(select.options).map((o) => o.value).join(",");
    if (current !== names.join(",")) select.replaceChildren(...names.map((n) => el("option", { value: n }, n)));
    select.value = treeWorker;
  }

  // -- the radix tree --------------------------------------------------------------------

  function layoutTree(nodes) {
    // an icicle: depth to the right, each node's height its share of its parent's pages
    const byParent = new Map();
    for (const n of nodes) {
      if (!byParent.has(n.parent_id)) byParent.set(n.parent_id, []);
      byParent.get(n.parent_id).push(n);
    }
    const placed = [];
    // a node's children share its height by the pages each holds (its own pages: the rest)
    function place(parentId, depth, y0, span, parentPages) {
      let y = y0;
      for (const n of byParent.get(parentId) || []) {
        const h = (span * n.subtree_pages) / Math.max(1, parentPages);
        placed.push({ node: n, depth, y, h });
        place(n.node_id, depth + 1, y, h, n.subtree_pages);
        y += h;
      }
    }
    const total = (byParent.get(0) || []).reduce((s, n) => s + n.subtree_pages, 0);
    place(0, 0, 0, 1, total);
    return placed;
  }

  function drawTree(data) {
    lastTree = data;
    const svg = document.getElementById("tree");
    const width = svg.clientWidth || 900;
    const height = svg.clientHeight || 360;
    const placed = layoutTree(data.nodes);
    const depth = Math.max(1, ...placed.map((p) => p.depth + 1));
    const colW = width / depth;
    const maxHits = Math.max(1, ...data.nodes.map((n) => n.hits));
    svg.replaceChildren();
    for (const p of placed) {
      const n = p.node;
      const g = svgEl("g", {
        class: "node" + (selectedNode === n.node_id ? " selected" : ""),
        "data-node-id": n.node_id, "data-hits": n.hits, "data-tokens": n.num_tokens,
        "data-prefix-tokens": n.prefix_tokens, "data-locks": n.locks, "data-pages": n.subtree_pages,
      });
      const shade = 92 - Math.round((30 * n.hits) / maxHits);
      const rect = svgEl("rect", {
        x: p.depth * colW, y: p.y * height, width: colW - 2, height: Math.max(1, p.h * height - 1),
        fill: n.locks > 0 ? `hsl(20, 80%, ${shade}%)` : `hsl(215, 70%, ${shade}%)`,
      });
      const title = svgEl("title", {});
      title.textContent = `node ${n.node_id}: ${n.num_tokens} tokens (prefix ${n.prefix_tokens}), ${n.subtree_pages} pages held, ${n.hits} hits, ${n.locks} locks, last hit ${ago(n.last_hit_s)}`;
      rect.append(title);
      g.append(rect);
      if (p.h * height >= 14) {
        const label = svgEl("text", { x: p.depth * colW + 4, y: p.y * height + 12 });
        const words = n.text !== undefined ? ` “${n.text}”` : "";
        label.textContent = `${n.num_tokens} tok · ${n.hits} hits · ${n.locks} locks · ${ago(n.last_hit_s)}${words}`;
        g.append(label);
        if (p.h * height >= 28) {
          const sub = svgEl("text", { x: p.depth * colW + 4, y: p.y * height + 25 });
          sub.textContent = `${n.subtree_pages} pages · prefix ${n.prefix_tokens} tok`;
          g.append(sub);
        }
      }
      g.addEventListener("click", () => selectNode(n.node_id));
      svg.append(g);
    }
    document.getElementById("tree-summary").textContent =
      `${data.nodes.length} largest of ${data.num_nodes} nodes, ${data.cached_pages} pages cached` +
      (data.prompt_text ? "" : " · prompt text hidden (token counts only)");
    if (selectedNode !== null) showNode(selectedNode);
  }

  function selectNode(id) {
    selectedNode = id;
    for (const g of document.querySelectorAll("#tree g.node")) g.classList.toggle("selected", Number(g.dataset.nodeId) === id);
    showNode(id);
  }

  function showNode(id) {
    const detail = document.getElementById("node-detail");
    const n = lastTree && lastTree.nodes.find((x) => x.node_id === id);
    if (!n) { detail.textContent = "That node is no longer among the largest."; return; }
    const requestLinks = (ids) => ids.map((rid) => {
      const a = el("a", { "data-request-id": rid }, rid);
      a.addEventListener("click", () => highlightRequest(rid));
      return [a, " "];
    }).flat();
    detail.replaceChildren(
      el("div", {}, `node ${n.node_id}: ${n.num_tokens} tokens, prefix ${n.prefix_tokens} tokens, ${n.num_pages} own pages, ${n.subtree_pages} held below, ${n.hits} hits, ${n.locks} locks, last hit ${ago(n.last_hit_s)}`),
      el("div", { id: "node-live" }, "live requests: ", ...(n.live_request_ids.length ? requestLinks(n.live_request_ids) : ["none"])),
      el("div", { id: "node-recent" }, "recent requests: ", ...(n.recent_request_ids.length ? requestLinks(n.recent_request_ids) : ["none"])),
    );
  }

  async function refreshTree() {
    if (!treeWorker) return;
    drawTree(await get(`/debug/explorer/tree?worker=${encodeURIComponent(treeWorker)}&nodes=48`));
  }

  // -- recent requests and their traces --------------------------------------------------

  function baseId(rid) { return rid.replace(/~\d+$/, "").replace(/-\d+$/, ""); }

  function highlightRequest(rid) {
    for (const row of document.querySelectorAll("#requests tbody tr")) {
      const on = row.dataset.requestId === rid || row.dataset.requestId === baseId(rid);
      row.classList.toggle("highlight", on);
      if (on) row.scrollIntoView({ block: "nearest" });
    }
  }

  function requestRow(r) {
    const route = r.route === "remote" ? `remote → ${r.prefill_worker}` : r.route || "–";
    const trace = r.trace_id ? el("a", { "data-trace-id": r.trace_id }, "timeline") : "–";
    if (r.trace_id) trace.addEventListener("click", () => showTrace(r.trace_id));
    const cells = [
      [new Date(r.started_s * 1000).toLocaleTimeString(), "started"], [r.request_id, "id"], [r.status, "status"],
      [route, "route"], [r.decode_worker || "–", "decode"], [r.prompt_tokens, "prompt"],
      [r.cached.total, "cached"], [r.cached.device, "device"], [r.cached.peer, "peer"], [r.cached.host, "host"],
      [r.cached.disk, "disk"], [r.completion_tokens, "completion"], [fmt(r.ttft_ms, 1), "ttft"],
      [fmt(r.itl_ms, 1), "itl"],
    ];
    const row = el("tr", { "data-request-id": r.request_id }, ...cells.map(([v, cls]) => el("td", { class: cls }, fmt(v))));
    row.append(el("td", { class: "trace" }, trace));
    return row;
  }

  async function refreshRequests() {
    const data = await get("/debug/explorer/requests?limit=100");
    lastRequests = data.requests;
    document.querySelector("#requests tbody").replaceChildren(...lastRequests.map(requestRow));
  }

  async function showTrace(traceId) {
    document.getElementById("trace-id").textContent = traceId;
    const box = document.getElementById("trace");
    let data;
    try {
      data = await get(`/debug/traces/${encodeURIComponent(traceId)}`);
    } catch (err) {
      box.textContent = String(err.message);
      return;
    }
    const spans = data.spans;
    const start = Math.min(...spans.map((s) => s.start_ns));
    const end = Math.max(...spans.map((s) => s.end_ns));
    const span = Math.max(1, end - start);
    const byId = new Map(spans.map((s) => [s.span_id, s]));
    const depthOf = (s) => { let d = 0; let p = s; while (p.parent_span_id && byId.has(p.parent_span_id) && d < 32) { p = byId.get(p.parent_span_id); d++; } return d; };
    // parents before children, siblings by start
    const ordered = [];
    const children = new Map();
    for (const s of spans) {
      const parent = s.parent_span_id && byId.has(s.parent_span_id) ? s.parent_span_id : null;
      if (!children.has(parent)) children.set(parent, []);
      children.get(parent).push(s);
    }
    const walk = (parent) => {
      for (const s of (children.get(parent) || []).sort((a, b) => a.start_ns - b.start_ns)) { ordered.push(s); walk(s.span_id); }
    };
    walk(null);
    const rows = ordered.map((s) => {
      const depth = depthOf(s);
      const left = (100 * (s.start_ns - start)) / span;
      const width = Math.max(0.3, (100 * (s.end_ns - s.start_ns)) / span);
      const ms = ((s.end_ns - s.start_ns) / 1e6).toFixed(2);
      return el("div", { class: "span", "data-name": s.name, "data-service": s.service },
        el("div", { class: "label", style: `padding-left:${depth * 12}px;width:300px` }, `${s.name} (${s.service}) ${ms} ms`),
        el("div", { style: "position:absolute;left:320px;right:0;top:0;bottom:0" },
          el("div", { class: `bar-fill svc-${s.service}`, style: `left:${left}%;width:${width}%`, title: JSON.stringify(s.attributes || {}) })));
    });
    box.replaceChildren(...rows);
  }

  // -- the autoscaler --------------------------------------------------------------------

  async function refreshAutoscaler() {
    const data = (await get("/debug/explorer/autoscaler")).autoscaler;
    const box = document.getElementById("autoscaler");
    if (!data) { box.textContent = "no autoscaler"; return; }
    if (data.error) { box.textContent = data.error; return; }
    const decisions = [...(data.recent || [])].reverse();
    const latest = (data.latest || []).map((d) => el("li", {}, `${d.role}: ${d.desired} replicas — ${d.reason}${d.advice ? " · advice: " + d.advice : ""}`));
    const recent = decisions.map((d) => el("li", {}, `${new Date(d.time_s * 1000).toLocaleTimeString()} ${d.role} ${d.direction} ${d.current} → ${d.desired} (${d.kind}): ${d.reason}${d.advice ? " · advice: " + d.advice : ""}`));
    box.replaceChildren(
      el("div", {}, `${data.url} · ${data.status} · connector ${data.connector}`),
      el("div", {}, "latest round:"), el("ul", {}, ...latest),
      el("div", {}, "recent decisions:"), recent.length ? el("ul", {}, ...recent) : el("div", { class: "note" }, "none but steady holds"),
    );
  }

  async function poll() {
    try {
      await refreshWorkers();
      await Promise.all([refreshTree(), refreshRequests(), refreshAutoscaler()]);
      setStatus("updated " + new Date().toLocaleTimeString());
    } catch (err) {
      setStatus(String(err.message), true);
    }
    setTimeout(poll, POLL_MS);
  }

  document.getElementById("tree-worker").addEventListener("change", (ev) => {
    treeWorker = ev.target.value;
    selectedNode = null;
    refreshTree().catch((err) => setStatus(String(err.message), true));
  });
  window.radixserveExplorer = { showTrace, selectNode, highlightRequest };
  poll();
})();
