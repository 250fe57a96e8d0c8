"""On-policy distillation from a teacher behind a URL (`algorithm.distill.teacher: http://.../v1`): a real
vLLM-format server on 127.0.0.1 (uvicorn, in a thread) serves a perturbed tiny model's prompt logprobs as vLLM's
OpenAI server does (`prompt_logprobs`); `RemoteTeacher` and the debug backbone's update are checked against the
model itself and against the same teacher loaded from its folder."""

import pytest
import torch
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from transformers import AutoModelForCausalLM

from ajet.remote_teacher import RemoteTeacher
from tests.local_servers import serving
from tests.test_learning_signal import _backbone, _episodes, _on_policy


def _prompt_logprobs_app(model, served: list) -> Starlette:
    """vLLM's answer shape: `choices[0].prompt_logprobs` = [None, {"<id>": {"logprob", "rank", "decoded_token"}}, ...]
    for `prompt_logprobs: 0` (the prompt's own token only), from the raw model (temperature 1). The served name is
    "teacher"; the name "no-prompt-logprobs" answers like a server without the extension. Each completions body is
    appended to `served`."""

    async def models(_: Request):
        return JSONResponse({"object": "list", "data": [{"id": "teacher", "object": "model"}]})

    async def completions(request: Request):
        body = await request.json()
        served.append(body)
        if body["model"] not in ("teacher", "no-prompt-logprobs"):
            return JSONResponse({"error": {"message": f"model {body['model']!r} does not exist"}}, status_code=404)
        choice = {"index": 0, "text": "", "finish_reason": "length"}
        if body["model"] == "teacher" and body.get("prompt_logprobs") is not None:
            ids = torch.tensor([body["prompt"]])
            with torch.no_grad():
                logprobs = model(input_ids=ids).logits[0, :-1].float().log_softmax(-1)     # [seq - 1, vocab]
            choice["prompt_logprobs"] = [None] + [
                {str(t): {"logprob": float(logprobs[i, t]), "rank": 1, "decoded_token": ""}}
                for i, t in enumerate(body["prompt"][1:])]
        return JSONResponse({"id": "cmpl-1", "object": "text_completion", "model": body["model"], "choices": [choice]})

    return Starlette(routes=[Route("/v1/models", models), Route("/v1/completions", completions, methods=["POST"])])


@pytest.fixture(scope="module")
def teacher(tiny_model_dir, tmp_path_factory):
    """(the teacher's folder, its model, the URL of a server that serves it, the completions bodies it served)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))     # a teacher that disagrees with the student
    folder = tmp_path_factory.mktemp("teacher")
    model.save_pretrained(folder)
    served: list[dict] = []
    with serving(_prompt_logprobs_app(model, served)) as url:
        yield str(folder), model, f"{url}/v1", served


def test_remote_teacher_returns_the_models_logprob_of_each_token_from_start(teacher):
    _, model, url, _ = teacher
    ids = [5, 17, 3, 99, 42, 7, 120]
    with torch.no_grad():
        want = model(input_ids=torch.tensor([ids])).logits[0].log_softmax(-1)   # [seq, vocab]
    remote = RemoteTeacher(url)
    try:
        assert remote.model == "teacher"                      # the first of /models
        got = remote.score(ids, start=4)
        assert got == pytest.approx([want[t - 1, ids[t]].item() for t in range(4, len(ids))], abs=1e-6)
        assert remote.score_many([(ids, 1), (ids[:3], 2)]) == [remote.score(ids, 1), remote.score(ids[:3], 2)]
        with pytest.raises(ValueError):
            remote.score(ids, start=0)                        # nothing conditions the first token
    finally:
        remote.close()


def test_a_server_without_prompt_logprobs_or_the_model_is_a_clear_error(teacher):
    _, _, url, _ = teacher
    for model, message in (("no-prompt-logprobs", "must support vLLM's `prompt_logprobs`"), ("nope", "404")):
        remote = RemoteTeacher(url, model)
        try:
            with pytest.raises(RuntimeError, match=message):
                remote.score([1, 2, 3], 1)
        finally:
            remote.close()


def test_url_teacher_trains_the_student_as_the_same_teacher_loaded_from_its_folder(tiny_model_dir, teacher):
    """At temperature 1 and top_p 1 (what a vLLM server's prompt logprobs are), the URL teacher and the folder
    teacher give the same distillation KL and the same gradient."""
    folder, _, url, _ = teacher
    results = []
    for source in (folder, url):
        bb = _backbone(tiny_model_dir, distill={"teacher": source, "mode": "replace"})
        try:
            samples = _episodes(4, seed=4)
            for s in samples:
                s.advantage, s.temperatures = 0.0, [1.0] * len(s.response_ids)   # only the teacher moves the student
            bb.model.zero_grad()
            stats = bb.accumulate_gradients(_on_policy(bb, samples))
            grad = torch.cat([p.grad.flatten() for p in bb.model.parameters() if p.grad is not None])
            results.append((stats["distill/kl"], grad))
        finally:
            bb.close()
    (kl_folder, g_folder), (kl_url, g_url) = results
    assert kl_folder > 0.05 and g_folder.norm() > 0           # the perturbed teacher disagrees
    assert kl_url == pytest.approx(kl_folder, rel=1e-4)
    assert ((g_url - g_folder).norm() / g_folder.norm()).item() < 1e-4


def test_an_update_fetches_each_samples_teacher_logprobs_once(tiny_model_dir, teacher):
    """Two PPO epochs x two mini-batches make four passes over the samples; the teacher's logprobs do not change
    in between, so the server is asked once per sample."""
    _, _, url, served = teacher
    bb = _backbone(tiny_model_dir, distill={"teacher": url}, ppo_epochs=2, mini_batches=2)
    try:
        samples = _on_policy(bb, _episodes(4, seed=6))
        before = len(served)
        stats = bb.update(samples)
    finally:
        bb.close()
    assert stats["optimizer_steps"] == 4.0 and stats["distill/kl"] != 0.0
    assert sorted(tuple(b["prompt"]) for b in served[before:]) == sorted(tuple(s.input_ids) for s in samples)
