// ajet view: a hash-routed page over the JSON API of ajet/viewer/app.py. Plain DOM, no framework, no build.
//   #/                          run overview (charts per step, steps table, plots)
//   #/step/N?order=&failed=...  GRPO groups and the episode list of a step (filters, search, paging)
//   #/episode/ID/ATTEMPT        calls in order, tool results, final answer, reward, samples
//   #/sample/ID/ATTEMPT/I       the sample token by token
//   #/compare/ID/A/ID2/A2       two episodes side by side
//   #/gateway                   a gateway's folder: versions served, gate decisions, rollbacks, feedback over time
"use strict";

const $main = document.getElementById("main");
const $tip = document.getElementById("tip");

// ---- small helpers --------------------------------------------------------------------------------
function h(tag, attrs, ...children) {          // build an element; strings become text nodes (never HTML)
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (k === "class") el.className = v;
    else el.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat(Infinity)) if (c !== null && c !== undefined && c !== false) el.append(c instanceof Node ? c : String(c));
  return el;
}
const render = (...children) => $main.replaceChildren(...children.flat(Infinity).filter(c => c !== null && c !== undefined && c !== false));
const fmt = (x, d = 3) => (x === null || x === undefined || Number.isNaN(x)) ? "–" : (typeof x === "number" ? (Number.isInteger(x) ? String(x) : x.toFixed(d)) : String(x));
let routeSeq = 0;                               // a view whose route was left while it loaded never renders
class Stale extends Error {}
async function api(path) {
  const seq = routeSeq;
  const r = await fetch(path);
  const body = await r.json();
  if (seq !== routeSeq) throw new Stale();
  if (!r.ok) throw new Error(body.error || r.statusText);
  return body;
}
function crumbs(...links) {
  const nav = document.getElementById("crumbs");
  nav.replaceChildren(...links.map(([label, href]) => href ? h("a", {href}, label) : h("span", {}, label)));
}
function parseHash() {
  const [path, query] = location.hash.replace(/^#/, "").split("?");
  return {parts: path.split("/").filter(Boolean).map(decodeURIComponent), params: new URLSearchParams(query || "")};
}
const epHref = (id, attempt) => `#/episode/${encodeURIComponent(id)}/${attempt}`;

// ---- charts: one SVG polyline per metric ------------------------------------------------------------
function chart(title, xs, ys) {
  const pts = xs.map((x, i) => [x, ys[i]]).filter(([, y]) => typeof y === "number" && Number.isFinite(y));
  const svgNS = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(svgNS, "svg");
  svg.setAttribute("viewBox", "0 0 300 120");
  svg.setAttribute("preserveAspectRatio", "none");
  const last = pts.length ? pts[pts.length - 1][1] : null;
  if (pts.length) {
    const [x0, x1] = [Math.min(...pts.map(p => p[0])), Math.max(...pts.map(p => p[0]))];
    let [y0, y1] = [Math.min(...pts.map(p => p[1])), Math.max(...pts.map(p => p[1]))];
    if (y0 === y1) { y0 -= 1; y1 += 1; }
    const sx = x => 30 + (x1 === x0 ? 120 : (x - x0) / (x1 - x0) * 262), sy = y => 110 - (y - y0) / (y1 - y0) * 100;
    const line = document.createElementNS(svgNS, "polyline");
    line.setAttribute("points", pts.map(([x, y]) => `${sx(x)},${sy(y)}`).join(" "));
    line.setAttribute("fill", "none"); line.setAttribute("stroke", "#2563eb"); line.setAttribute("stroke-width", "2");
    line.setAttribute("vector-effect", "non-scaling-stroke");
    svg.append(line);
    for (const [y, label] of [[y1, fmt(y1, 2)], [y0, fmt(y0, 2)]]) {
      const t = document.createElementNS(svgNS, "text");
      t.setAttribute("x", "0"); t.setAttribute("y", String(sy(y) + 4)); t.setAttribute("font-size", "9"); t.setAttribute("fill", "#6b7280");
      t.textContent = label; svg.append(t);
    }
    for (const [x, y] of pts) {
      const c = document.createElementNS(svgNS, "circle");
      c.setAttribute("cx", sx(x)); c.setAttribute("cy", sy(y)); c.setAttribute("r", "2.5"); c.setAttribute("fill", "#1d4ed8");
      const tt = document.createElementNS(svgNS, "title"); tt.textContent = `step ${x}: ${fmt(y, 4)}`; c.append(tt);
      svg.append(c);
    }
  }
  return h("div", {class: "chart"}, h("div", {class: "title"}, `${title}  (last ${fmt(last)})`), svg);
}

// ---- views ----------------------------------------------------------------------------------------
async function overview() {
  const run = await api("/api/run");
  document.getElementById("run-name").textContent = `${run.experiment_name} · ${run.model || ""}`;
  crumbs(["overview"]);
  const last = run.steps[run.steps.length - 1] || {};
  const total = run.steps.reduce((a, s) => a + s.episodes, 0), failed = run.steps.reduce((a, s) => a + s.failed, 0);
  const xs = run.metrics.map(m => m.step);
  render(
    h("h2", {}, "Run"),
    h("div", {class: "cards"},
      h("div", {class: "card"}, h("b", {}, run.steps.length), "steps recorded"),
      h("div", {class: "card"}, h("b", {}, total), "episodes"),
      h("div", {class: "card"}, h("b", {class: failed ? "bad" : ""}, failed), "failed"),
      h("div", {class: "card"}, h("b", {}, fmt(last.reward_mean)), "last step reward"),
      h("div", {class: "card"}, h("b", {}, fmt(run.policy_version)), "policy version"),
      h("div", {class: "card"}, h("b", {}, run.backbone || "–"), "backbone")),
    h("div", {class: "muted"}, run.exp_dir),
    run.gateway ? h("p", {}, h("a", {id: "gateway-link", href: "#/gateway"}, "gateway: versions served, gate decisions and feedback over time →")) : null,
    h("h2", {}, "Per step"),
    run.metrics.length ? h("div", {class: "charts", id: "charts"}, run.chart_keys.map(k => chart(k, xs, run.metrics.map(m => m[k]))))
                       : h("p", {class: "muted"}, "no metrics.jsonl yet"),
    h("h2", {}, "Steps"),
    h("table", {id: "steps"},
      h("tr", {}, ["step", "attempt", "episodes", "failed", "tasks", "reward mean", "min", "max"].map(c => h("th", {}, c))),
      run.steps.map(s => h("tr", {},
        h("td", {}, h("a", {class: "step-link", href: `#/step/${s.step}?attempt=${s.attempt}`}, `step ${s.step}`)),
        h("td", {class: "num"}, s.attempt), h("td", {class: "num"}, s.episodes),
        h("td", {class: "num" + (s.failed ? " bad" : "")}, s.failed), h("td", {class: "num"}, s.tasks),
        h("td", {class: "num"}, fmt(s.reward_mean)), h("td", {class: "num"}, fmt(s.reward_min)), h("td", {class: "num"}, fmt(s.reward_max))))),
    run.plots.length ? h("div", {class: "plots"}, h("h2", {}, "Plots (EXP_DIR/plots)"), run.plots.map(p => h("img", {src: `/plots/${p}`, alt: p}))) : null);
}

async function stepView(step, params) {
  const attempt = params.get("attempt") || "";
  const q = new URLSearchParams({step, attempt, order: params.get("order") || "group", failed: params.get("failed") || "",
    fork: params.get("fork") || "", agent: params.get("agent") || "", group: params.get("group") || "", q: params.get("q") || "",
    offset: params.get("offset") || "0", limit: "50"});
  const [groups, page] = await Promise.all([api(`/api/groups?step=${step}&attempt=${attempt}`), api(`/api/episodes?${q}`)]);
  crumbs(["overview", "#/"], [`step ${step}`]);
  const go = changes => {
    const p = new URLSearchParams(params);
    for (const [k, v] of Object.entries(changes)) v === "" ? p.delete(k) : p.set(k, v);
    if (!("offset" in changes)) p.delete("offset");
    location.hash = `#/step/${step}?${p}`;
  };
  const sel = (name, options) => h("select", {name, onchange: e => go({[name]: e.target.value})},
    options.map(([v, label]) => h("option", {value: v, selected: (params.get(name) || "") === v}, label)));
  const search = h("input", {name: "q", placeholder: "search messages, answers, errors", value: params.get("q") || "", size: 32});
  const chosen = new Set();
  const compareBtn = h("button", {type: "button", id: "compare", disabled: true, onclick: () => {
    const [a, b] = [...chosen].map(s => s.split("|"));
    location.hash = `#/compare/${encodeURIComponent(a[0])}/${a[1]}/${encodeURIComponent(b[0])}/${b[1]}`;
  }}, "compare 2 selected");
  let prevGroup = null;
  const rows = page.episodes.map(e => {
    const key = `${e.episode_id}|${e.attempt}`;
    const start = e.group_id !== prevGroup; prevGroup = e.group_id;
    return h("tr", {class: start ? "group-start" : ""},
      h("td", {}, h("input", {type: "checkbox", onchange: ev => { ev.target.checked ? chosen.add(key) : chosen.delete(key); compareBtn.disabled = chosen.size !== 2; }})),
      h("td", {}, h("a", {class: "episode-link", href: epHref(e.episode_id, e.attempt)}, e.episode_id)),
      h("td", {}, h("a", {href: "#", onclick: ev => { ev.preventDefault(); go({group: e.group_id}); }}, e.group_id)),
      h("td", {class: "num"}, fmt(e.reward)), h("td", {class: "num"}, fmt(e.advantage)), h("td", {class: "num"}, fmt(e.duration_s, 1)),
      h("td", {class: "num"}, e.calls), h("td", {class: "num"}, e.samples), h("td", {}, e.fork_reasons.join(", ")),
      h("td", {}, e.agent_tags.join(", ")), h("td", {class: "bad"}, e.failure || ""));
  });
  const offset = page.offset;
  render(
    h("h2", {}, `Step ${step}: GRPO groups`),
    h("table", {id: "groups"}, h("tr", {}, ["group", "task", "episodes", "failed", "reward mean", "min", "max"].map(c => h("th", {}, c))),
      groups.map(g => h("tr", {}, h("td", {}, h("a", {href: "#", onclick: ev => { ev.preventDefault(); go({group: g.group_id}); }}, g.group_id)),
        h("td", {}, g.task_id), h("td", {class: "num"}, g.episodes), h("td", {class: "num" + (g.failed ? " bad" : "")}, g.failed),
        h("td", {class: "num"}, fmt(g.reward_mean)), h("td", {class: "num"}, fmt(g.reward_min)), h("td", {class: "num"}, fmt(g.reward_max))))),
    h("h2", {}, "Episodes"),
    h("form", {class: "filters", onsubmit: e => { e.preventDefault(); go({q: search.value}); }},
      sel("order", [["group", "by group"], ["advantage_desc", "best advantage"], ["advantage_asc", "worst advantage"],
                    ["reward_desc", "highest reward"], ["reward_asc", "lowest reward"], ["duration_desc", "slowest"]]),
      sel("failed", [["", "all episodes"], ["1", "failed only"], ["0", "successful only"]]),
      h("input", {name: "fork", placeholder: "fork reason (or any)", value: params.get("fork") || "", size: 16, onchange: e => go({fork: e.target.value})}),
      h("input", {name: "agent", placeholder: "agent tag", value: params.get("agent") || "", size: 10, onchange: e => go({agent: e.target.value})}),
      search, h("button", {type: "submit"}, "search"),
      params.get("group") ? h("button", {type: "button", onclick: () => go({group: ""})}, `group ${params.get("group")} ✕`) : null,
      compareBtn),
    h("div", {class: "pager"},
      h("button", {disabled: offset === 0, onclick: () => go({offset: Math.max(0, offset - page.limit)})}, "‹ prev"),
      h("span", {class: "muted"}, `${page.total ? offset + 1 : 0}–${offset + page.episodes.length} of ${page.total}`),
      h("button", {disabled: offset + page.limit >= page.total, onclick: () => go({offset: offset + page.limit})}, "next ›")),
    h("table", {id: "episodes"}, h("tr", {}, ["", "episode", "group", "reward", "advantage", "seconds", "calls", "samples", "forks", "agents", "failure"].map(c => h("th", {}, c))), rows));
}

// how a call's prompt was built: extends its parent (found by a tool-call id the proxy issued, or by text), or in full
function parentText(c) {
  return c.prompt_parent ? `extends ${c.prompt_parent} (parent found by ${c.prompt_parent_by || "text"})`
                         : `rendered in full (${c.prompt_render_reason})`;
}

function messageBlock(m) {
  let body = typeof m.content === "string" ? m.content : (m.content ? JSON.stringify(m.content, null, 1) : "");
  if (m.tool_calls) body += (body ? "\n" : "") + m.tool_calls.map(t => `→ ${t.function?.name}(${t.function?.arguments})`).join("\n");
  return h("div", {class: `msg ${m.role}`}, h("span", {class: "role"}, m.role + (m.tool_call_id ? ` (${m.tool_call_id})` : "")), body || "(empty)");
}

function episodeBody(ep) {
  const out = ep.output || {};
  const seen = new Set();   // each call's messages repeat the history: show only the new ones
  return [
    h("div", {class: "cards"},
      h("div", {class: "card"}, h("b", {}, fmt(ep.reward)), "reward"),
      h("div", {class: "card"}, h("b", {}, fmt(ep.samples[0]?.advantage)), "advantage"),
      h("div", {class: "card"}, h("b", {}, ep.calls.length), "calls"),
      h("div", {class: "card"}, h("b", {}, fmt(ep.duration_s, 1)), "seconds"),
      h("div", {class: "card"}, h("b", {}, ep.group_id), "GRPO group"),
      h("div", {class: "card"}, h("b", {}, (ep.trained_in || []).map(([st, at]) => `step ${st}` + (at ? ` (attempt ${at})` : "")).join(", ") || (ep.not_trained ? `not trained: ${ep.not_trained}` : "–")), "trained in update")),
    h("h3", {}, "Task"), h("pre", {}, ep.task?.query || ""), h("div", {class: "muted"}, `expected answer: ${ep.task?.answer ?? "–"}`),
    ep.error ? [h("h3", {class: "bad"}, "Failure"), h("pre", {class: "bad"}, ep.error)] : null,
    h("h3", {}, "Final answer"), h("pre", {}, out.final_answer ?? "(none)"),
    out.metadata?.tests ? [h("h3", {}, "Tests"), h("table", {class: "tests"}, Object.entries(out.metadata.tests).map(([id, r]) =>
      h("tr", {}, h("td", {}, id), h("td", {class: r === "passed" ? "" : "bad"}, r))))] : null,
    typeof out.metadata?.diff === "string" ? [h("h3", {}, "What the agent changed"), h("pre", {class: "diff"}, out.metadata.diff || "(no change)")] : null,
    out.metrics && Object.keys(out.metrics).length ? h("div", {class: "muted"}, "workflow metrics: " + JSON.stringify(out.metrics)) : null,
    h("h3", {}, `Samples (${ep.samples_source})`),
    ep.samples.length ? h("div", {class: "scroll"}, h("table", {class: "samples"}, h("tr", {}, ["sample", "agent", "calls", "prompt tokens", "response tokens", "trained tokens", "advantage", "trained", "flags"].map(c => h("th", {}, c))),
      ep.samples.map(s => h("tr", {}, h("td", {}, h("a", {class: "sample-link", href: `#/sample/${encodeURIComponent(ep.episode_id)}/${ep.attempt}/${s.index}`}, `sample ${s.index}`)),
        h("td", {}, s.agent_tag), h("td", {}, s.call_ids.length), h("td", {class: "num"}, s.prompt_tokens), h("td", {class: "num"}, s.response_tokens),
        h("td", {class: "num"}, s.loss_tokens), h("td", {class: "num"}, fmt(s.advantage)), h("td", {}, fmt(s.trained)), h("td", {}, JSON.stringify(s.flags))))))
      : h("p", {class: "muted"}, "no samples (failed episodes are not trained on)"),
    h("h3", {}, "Calls"),
    ep.calls.map(c => {
      const fresh = (c.messages || []).filter(m => { const k = JSON.stringify(m); if (seen.has(k)) return false; seen.add(k); return true; });
      const t = c.timings || {};
      return h("div", {class: "call"},
        h("div", {}, h("b", {}, `call ${c.index}`), ` · agent ${c.agent_tag} · policy v${c.policy_version} · finish ${c.finish_reason}`),
        h("div", {class: "meta"}, `prompt ${c.prompt_tokens} tok, completion ${c.completion_tokens} tok, mean logprob ${fmt(c.mean_logprob)} · ` +
          `latency ${fmt(t.total_s, 2)} s (generate ${fmt(t.generate_s, 2)} s) · sampling ${JSON.stringify(c.sampling)} · ` +
          parentText(c)),
        c.tools ? h("details", {}, h("summary", {}, `${c.tools.length} tool(s)`), h("pre", {}, JSON.stringify(c.tools, null, 1))) : null,
        fresh.map(messageBlock),
        h("div", {class: "muted"}, "→ response"), messageBlock(c.response_message || {role: "assistant", content: ""}));
    })];
}

async function episodeView(id, attempt) {
  const ep = await api(`/api/episode/${encodeURIComponent(id)}?attempt=${attempt}`);
  crumbs(["overview", "#/"], [`step ${ep.step}`, `#/step/${ep.step}?attempt=${ep.attempt}&group=${encodeURIComponent(ep.group_id)}`], [ep.episode_id]);
  render(h("h2", {}, `Episode ${ep.episode_id}`, ep.attempt ? ` (attempt ${ep.attempt})` : ""), episodeBody(ep));
}

// ---- the token view -------------------------------------------------------------------------------
function probColor(lp) {        // engine probability -> background: green (likely) .. red (unlikely)
  const p = Math.exp(lp);
  return `hsl(${Math.round(120 * p)}, 75%, ${Math.round(78 + 10 * p)}%)`;
}

function tokenView(s, from = 0) {   // from: first position drawn (compare skips the shared prompt)
  const box = h("div", {class: "tokens"});
  if (from > 0) box.append(h("span", {class: "muted"}, `… ${from} prompt tokens not shown …\n`));
  const starts = new Map(s.calls.map(c => [c.start, c])), compStarts = new Map(s.calls.map(c => [c.completion_start, c]));
  for (let i = from; i < s.ids.length; i++) {
    if (starts.has(i)) box.append(h("span", {class: "boundary"}, `call ${starts.get(i).index ?? "?"}`));
    if (compStarts.has(i)) box.append(h("span", {class: "boundary completion"}, `sampled by call ${compStarts.get(i).index ?? "?"}`));
    if (s.fork_at === i) box.append(h("span", {class: "fork"}, `fork: ${s.flags.fork_reason || "leaves an earlier sample"}`));
    const m = s.loss_mask[i], lp = s.logprobs[i];
    const cls = "tok " + (m ? "trained" : "untrained") + (lp !== null && !m ? " sampled" : "") + (i < s.prompt_len ? " prompt" : "");
    const text = s.text[i];
    const el = h("span", {class: cls, "data-i": i}, text.replace(/\n/g, "↵\n"));
    if (m && lp !== null) el.style.background = probColor(lp);
    box.append(el);
  }
  const info = i => {
    const lp = s.logprobs[i], pv = s.policy_versions ? s.policy_versions[i] : null;
    const call = s.calls.find(c => i >= c.start && i < c.completion_end);
    let t = `#${i}  id ${s.ids[i]}  ${JSON.stringify(s.pieces[i])}\n` +
      `loss mask ${s.loss_mask[i]} (${s.loss_mask[i] ? "trained" : "not trained"})${i < s.prompt_len ? ", prompt" : ""}\n` +
      `logprob ${lp === null ? "– (not sampled)" : `${lp.toFixed(4)}  p=${Math.exp(lp).toFixed(3)}`}\n` +
      `advantage ${fmt(s.advantage)}` + (pv !== null && pv >= 0 ? `  policy v${pv}` : "") + (call ? `  call ${call.index}` : "");
    const top = s.top_logprobs[i];
    if (top) t += "\ntop: " + top.map(([tx, l]) => `${JSON.stringify(tx)} ${l.toFixed(3)}`).join("  ");
    return t;
  };
  box.addEventListener("mousemove", e => {
    const i = e.target.dataset?.i;
    if (i === undefined) { $tip.hidden = true; return; }
    $tip.textContent = info(+i); $tip.hidden = false;
    $tip.style.left = Math.min(e.clientX + 14, innerWidth - 440) + "px"; $tip.style.top = (e.clientY + 16) + "px";
  });
  box.addEventListener("mouseleave", () => { $tip.hidden = true; });
  return box;
}

function sampleHeader(s) {
  const trained = s.loss_mask.reduce((a, b) => a + b, 0);
  return [
    h("div", {class: "cards"},
      h("div", {class: "card"}, h("b", {}, fmt(s.advantage)), "advantage"),
      h("div", {class: "card"}, h("b", {}, fmt(s.reward)), "reward"),
      h("div", {class: "card"}, h("b", {}, `${trained} / ${s.ids.length}`), "trained / all tokens"),
      h("div", {class: "card"}, h("b", {}, s.calls.length), "calls merged"),
      h("div", {class: "card"}, h("b", {}, fmt(s.trained)), "in the update"),
      h("div", {class: "card"}, h("b", {}, fmt(s.temperature)), "temperature")),
    h("div", {class: "muted"}, `flags ${JSON.stringify(s.flags)} · samples from ${s.samples_source}` + (s.tokenizer ? ` · ${s.tokenizer}` : "")),
    h("div", {class: "legend"},
      h("span", {}, h("span", {class: "swatch", style: `background:${probColor(-0.05)}`}), h("span", {class: "swatch", style: `background:${probColor(-1.5)}`}),
        h("span", {class: "swatch", style: `background:${probColor(-8)}`}), "trained (loss mask 1), shaded by engine probability: likely → unlikely"),
      h("span", {}, h("span", {class: "tok untrained"}, "grey"), " not trained (prompt, tool results, template)"),
      h("span", {}, h("span", {class: "boundary"}, "call n"), " where a call's new tokens start"),
      h("span", {}, h("span", {class: "boundary completion"}, "sampled"), " where its completion starts"),
      h("span", {class: "muted"}, "hover a token for id, logprob, advantage"))];
}

async function sampleView(id, attempt, index) {
  const s = await api(`/api/episode/${encodeURIComponent(id)}/sample/${index}?attempt=${attempt}`);
  crumbs(["overview", "#/"], [id, epHref(id, attempt)], [`sample ${index}`]);
  render(h("h2", {}, `Episode ${id} · sample ${index} (${s.agent_tag})`), sampleHeader(s), tokenView(s));
}

async function compareView(a, aAttempt, b, bAttempt) {
  const [ea, eb] = await Promise.all([api(`/api/episode/${encodeURIComponent(a)}?attempt=${aAttempt}`), api(`/api/episode/${encodeURIComponent(b)}?attempt=${bAttempt}`)]);
  crumbs(["overview", "#/"], [`step ${ea.step}`, `#/step/${ea.step}?attempt=${ea.attempt}`], ["compare"]);
  const [better, worse] = (eb.reward ?? -Infinity) > (ea.reward ?? -Infinity) ? [eb, ea] : [ea, eb];
  const col = async ep => {
    const s = ep.samples.length ? await api(`/api/episode/${encodeURIComponent(ep.episode_id)}/sample/0?attempt=${ep.attempt}`) : null;
    return h("div", {}, h("h2", {}, h("a", {href: epHref(ep.episode_id, ep.attempt)}, ep.episode_id), ` · reward ${fmt(ep.reward)}`),
      s ? [h("h3", {}, `sample 0 · advantage ${fmt(s.advantage)}`), tokenView(s, s.prompt_len)] : null, episodeBody(ep));
  };
  const note = ea.group_id === eb.group_id ? "" : " (different GRPO groups)";
  render(h("p", {class: "muted"}, `higher reward on the left${note}`), h("div", {class: "compare"}, await col(better), await col(worse)));
}

// ---- a gateway's folder: versions, the gate's decisions, rollbacks, feedback over time ------------------------
const when = t => (t === null || t === undefined) ? "–" : new Date(t * 1000).toISOString().replace("T", " ").slice(0, 19);
const table = (id, head, rows) => h("table", {id}, h("tr", {}, head.map(c => h("th", {}, c))), rows);

async function gatewayView() {
  const g = await api("/api/gateway?windows=50");
  crumbs(["overview", "#/"], ["gateway"]);
  const f = g.feedback, t0 = f.windows.length ? f.windows[0].start : 0;
  const xs = f.windows.map(w => ((w.start + w.end) / 2 - t0) / 60);
  const refused = g.gate.filter(d => !d.served).length;
  render(
    h("h2", {}, "Gateway"),
    h("div", {class: "cards"},
      h("div", {class: "card"}, h("b", {}, fmt(g.policy_version)), "policy version served"),
      h("div", {class: "card"}, h("b", {}, g.versions.length), "versions served"),
      h("div", {class: "card"}, h("b", {}, g.gate.length), "gate decisions"),
      h("div", {class: "card"}, h("b", {class: refused ? "bad" : ""}, refused), "refused"),
      h("div", {class: "card"}, h("b", {}, g.sessions.total), "sessions"),
      h("div", {class: "card"}, h("b", {}, f.count), `feedback (${f.by_source.client} client, ${f.by_source.judge} judge)`),
      h("div", {class: "card"}, h("b", {}, fmt(f.reward_mean)), "mean reward")),
    h("h2", {}, "Feedback over time"),
    f.windows.length ? h("div", {class: "charts", id: "feedback-charts"},
      chart("mean reward per window (x: minutes since the first feedback)", xs, f.windows.map(w => w.reward_mean)),
      chart("feedback per window", xs, f.windows.map(w => w.count))) : h("p", {class: "muted"}, "no feedback yet"),
    h("h2", {}, "Policy versions served"),
    table("versions", ["version", "how", "step", "gate figure", "since"], g.versions.map(v => h("tr", {},
      h("td", {class: "num"}, v.version), h("td", {}, v.how), h("td", {class: "num"}, v.step), h("td", {class: "num"}, fmt(v.figure)), h("td", {}, when(v.at))))),
    h("h2", {}, "Gate decisions"),
    g.gate.length ? table("gate", ["step", "candidate", "serving", "metric", "serving figure", "candidate figure", "max drop", "decision", "reason", "at"],
      g.gate.map(d => h("tr", {class: d.served ? "" : "refused"},
        h("td", {class: "num"}, d.step), h("td", {class: "num"}, d.candidate_version), h("td", {class: "num"}, d.serving_version), h("td", {}, d.metric),
        h("td", {class: "num"}, fmt(d.serving_figure)), h("td", {class: "num"}, fmt(d.candidate_figure)), h("td", {class: "num"}, fmt(d.max_drop)),
        h("td", {class: d.served ? "" : "bad"}, d.served ? "served" : "refused"), h("td", {}, d.reason), h("td", {}, when(d.at)))))
      : h("p", {class: "muted"}, "no gated update yet (gateway.gate.mode off, or no update)"),
    g.rollbacks.length ? [h("h2", {}, "Rollbacks"), table("rollbacks", ["id", "to", "asked", "done", "outcome"], g.rollbacks.map(r => h("tr", {},
      h("td", {class: "num"}, r.id), h("td", {class: "num"}, fmt(r.to_version)), h("td", {}, when(r.requested_at)), h("td", {}, when(r.done_at)),
      h("td", {class: r.ok === 0 ? "bad" : ""}, r.message || "pending"))))] : null,
    h("h2", {}, "Latest feedback"),
    table("feedback", ["received", "session", "reward", "source", "key", "comment"], f.recent.map(x => h("tr", {},
      h("td", {}, when(x.received_at)), h("td", {}, x.session_id), h("td", {class: "num"}, fmt(x.reward)), h("td", {}, x.source),
      h("td", {}, x.key_name || ""), h("td", {}, x.comment || "")))));
}

async function route() {
  const {parts, params} = parseHash();
  const seq = ++routeSeq;
  $tip.hidden = true;
  try {
    if (parts[0] === "step") await stepView(parts[1], params);
    else if (parts[0] === "episode") await episodeView(parts[1], parts[2] ?? "");
    else if (parts[0] === "sample") await sampleView(parts[1], parts[2], parts[3]);
    else if (parts[0] === "compare") await compareView(parts[1], parts[2], parts[3], parts[4]);
    else if (parts[0] === "gateway") await gatewayView();
    else await overview();
  } catch (err) {
    if (err instanceof Stale || seq !== routeSeq) return;
    render(h("p", {class: "bad"}, `error: ${err.message}`), h("a", {href: "#/"}, "back to the overview"));
  }
  if (seq === routeSeq) document.body.dataset.view = parts[0] || "overview";   // lets tests and screenshots wait for a view
}
addEventListener("hashchange", route);
route();
setInterval(() => { if (["", "#/", "#/gateway"].includes(location.hash)) route(); }, 10000);   // they follow a live run
