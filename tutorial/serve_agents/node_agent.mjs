// A Node.js agent trained by `ajet serve`, with nothing but Node's built-in fetch (Node >= 18, no npm).
//
//   AJET_URL=http://127.0.0.1:8765 AJET_SECRET=... node tutorial/serve_agents/node_agent.mjs
//
// Loop: begin an episode (the server hands out the next task), ask the model through the episode's
// OpenAI-compatible base_url (every call is recorded for training), score the answer, finish with the
// reward (AJET_DATASET: ask for tasks of that dataset only). Stops when the server says the run is finished (410 run_finished), or after AJET_MAX_EPISODES.
// Prints one JSON line per finished episode: {"episode_id", "reward"}.

const url = (process.env.AJET_URL || "http://127.0.0.1:8765").replace(/\/$/, "");
const secret = process.env.AJET_SECRET || "";
const retryForMs = 1000 * Number(process.env.AJET_RETRY_S || 120);
const maxEpisodes = Number(process.env.AJET_MAX_EPISODES || Infinity);
const clientId = `node-${process.pid}`;
const dataset = process.env.AJET_DATASET || undefined;        // a multi-task run: the dataset this agent serves
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// POST/GET to the episode API; retries lost connections and 503s (no task yet, or the server restarting
// after its trainer stopped: wait for it); returns [status, body]. `token`: the episode's episode_token,
// which the calls on one episode must carry (only the client that began an episode can end it).
async function api(method, path, body, token) {
  const deadline = Date.now() + retryForMs;
  for (let attempt = 0; ; attempt++) {
    let res;
    try {
      res = await fetch(url + "/ajet/v1" + path, {
        method,
        headers: { "Authorization": `Bearer ${secret}`, "Content-Type": "application/json",
                   ...(token ? { "X-Ajet-Episode-Token": token } : {}) },
        body: body === undefined ? undefined : JSON.stringify(body),
      });
    } catch (err) {                              // server restarting or unreachable: back off and retry
      if (Date.now() > deadline) throw err;
      await sleep(Math.min(200 * 2 ** attempt, 5000));
      continue;
    }
    const data = await res.json().catch(() => ({}));
    if ([502, 503, 504].includes(res.status) && Date.now() < deadline) {
      await sleep(Math.min(200 * 2 ** attempt, 1000 * Number(res.headers.get("retry-after") || 5)));
      continue;
    }
    return [res.status, data];
  }
}

// The agent itself: one chat completion through the episode's recording endpoint.
async function solve(ep) {
  const res = await fetch(ep.base_url + "/chat/completions", {
    method: "POST",
    headers: { "Authorization": `Bearer ${ep.api_key}`, "Content-Type": "application/json" },
    body: JSON.stringify({ model: ep.model, messages: [{ role: "user", content: ep.task.query }] }),
  });
  if (!res.ok) throw new Error(`chat completion failed: ${res.status} ${await res.text()}`);
  const answer = (await res.json()).choices[0].message.content || "";
  const reward = ep.task.answer != null && answer.includes(ep.task.answer) ? 1 : answer.length % 3;
  return { answer, reward };
}

let done = 0;
while (done < maxEpisodes) {
  const [status, ep] = await api("POST", "/episodes", { client_id: clientId, dataset });
  if (status === 410) break;                                       // run_finished
  if (status !== 200) throw new Error(`begin failed: ${status} ${JSON.stringify(ep)}`);
  try {
    const { answer, reward } = await solve(ep);
    const [fs, fin] = await api("POST", `/episodes/${ep.episode_id}/finish`, { reward, final_answer: answer },
                                   ep.episode_token);
    if (fs === 200 || fin.error?.code === "episode_already_finished") {
      console.log(JSON.stringify({ episode_id: ep.episode_id, reward }));
      done++;
    } else {
      console.error(`finish refused: ${fs} ${JSON.stringify(fin)}`);  // abandoned, or the server restarted
    }
  } catch (err) {
    await api("POST", `/episodes/${ep.episode_id}/finish`, { error: String(err.stack || err) }, ep.episode_token);
  }
}
