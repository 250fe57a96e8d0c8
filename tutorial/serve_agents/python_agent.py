"""A Python agent trained by `ajet serve`, through `ajet.client` (the same loop as node_agent.mjs).

    AJET_URL=http://127.0.0.1:8765 AJET_SECRET=... python tutorial/serve_agents/python_agent.py

Prints one JSON line per finished episode: {"episode_id", "reward"}. AJET_DATASET: ask for tasks of that
dataset only (a multi-task run).
"""

import json
import os

import httpx
import openai

from ajet.client import AjetClient, EpisodeGone, RunFinished


def main() -> None:
    openai.OpenAI(api_key="-", base_url="http://127.0.0.1:9").chat.completions   # load the SDK before any episode
    client = AjetClient(retry_for_s=float(os.environ.get("AJET_RETRY_S", "120")))
    done, limit = 0, int(os.environ.get("AJET_MAX_EPISODES", "1000000"))
    while done < limit:
        try:
            with client.episode(dataset=os.environ.get("AJET_DATASET")) as ep:
                r = ep.openai(max_retries=0).chat.completions.create(
                    model=ep.model, messages=[{"role": "user", "content": ep.task["query"]}])
                answer = r.choices[0].message.content or ""
                reward = 1.0 if ep.task.get("answer") and ep.task["answer"] in answer else float(len(answer) % 3)
                ep.finish(reward=reward, final_answer=answer)
        except RunFinished:
            break
        except (EpisodeGone, openai.APIError):   # abandoned, or the server restarted: begin the next one
            continue
        except httpx.TransportError as exc:   # the server stayed away longer than AJET_RETRY_S
            raise SystemExit(f"python_agent: the server at {client.url} is unreachable: {exc!r}")
        print(json.dumps({"episode_id": ep.episode_id, "reward": reward}), flush=True)
        done += 1


if __name__ == "__main__":
    main()
