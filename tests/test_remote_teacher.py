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

from ajet.backbones.debug.remote_teacher import RemoteTeacher
from tests.local_servers import serving
from tests.test_learning_signal import _backbone, _episodes, _on_policy


INF_ID = 500  # the servers below give this token id logprob -inf, which vLLM's JSON answer writes as -9999.0


def _prompt_logprobs_app(model, served: list, shift: float = 0.0) -> Starlette:
    """vLLM's answer shape: `choices[0].prompt_logprobs` = [None, {"<id>": {"logprob", "rank", "decoded_token"}}, ...]
    for `prompt_logprobs: 0` (the prompt's own token only), from the raw model (temperature 1), plus `shift`; token
    id INF_ID gets -9999.0 (vLLM's -inf). The served name is "teacher"; the name "no-prompt-logprobs" answers like a
    server without the extension. Each completions body is appended to `served`."""

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
                {str(t): {"logprob": -9999.0 if t == INF_ID else float(logprobs[i, t]) + shift, "rank": 1,
                          "decoded_token": ""}}
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


def test_vllms_minus_9999_is_read_as_minus_infinity(teacher):
    """vLLM writes a -inf prompt logprob as -9999.0 (JSON has no infinity): `score` gives -inf there, and the
    model's own logprob everywhere else."""
    _, model, url, _ = teacher
    ids = [5, 17, INF_ID, 99, INF_ID, 7]
    with torch.no_grad():
        want = model(input_ids=torch.tensor([ids])).logits[0].log_softmax(-1)   # [seq, vocab]
    remote = RemoteTeacher(url)
    try:
        got = remote.score(ids, start=1)
    finally:
        remote.close()
    assert got[1] == float("-inf") and got[3] == float("-inf")
    assert [got[i] for i in (0, 2, 4)] == pytest.approx([want[t - 1, ids[t]].item() for t in (1, 3, 5)], abs=1e-6)


@pytest.fixture(scope="module")
def shifted_teacher(tiny_model_dir):
    """The URL of a teacher whose logprob of every token is the untrained student's minus 0.3 (INF_ID: -inf)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with serving(_prompt_logprobs_app(model, [], shift=-0.3)) as url:
        yield f"{url}/v1"


def _two_episodes(inf_token: bool):
    """Two episodes of 4 response tokens at temperature 1, advantage 1 each; with `inf_token` the second one's last
    response token is INF_ID."""
    from ajet.tracker.sample import Sample

    g = torch.Generator().manual_seed(11)
    out = []
    for i in range(2):
        resp = torch.randint(3, 200, (4,), generator=g).tolist()
        if inf_token and i == 1:
            resp[-1] = INF_ID
        out.append(Sample(episode_id=f"e{i}", group_id="g", agent_tag="default", call_ids=["c"],
                          prompt_ids=torch.randint(3, 200, (6,), generator=g).tolist(), response_ids=resp,
                          loss_mask=[1] * 4, old_logprobs=[0.0] * 4, policy_versions=[0] * 4, advantage=1.0))
    return out


def test_distill_add_mode_adds_coef_times_the_reverse_kl_to_the_ppo_loss(tiny_model_dir, shifted_teacher):
    """`mode: add`, coef 0.5, on fresh samples (ratio 1) of two 4-token episodes with advantage 1: every token weighs
    1/8 (seq-mean-token-mean), the PPO loss is -sum_t w_t A = -1, the teacher gives every token 0.3 nats less than
    the student, so kl_t = 0.3 and distill/kl = 0.3; loss = -1 + 0.5 * 0.3 = -0.85 (by hand). The gradient is
    that of -(1 - 0.5 * 0.3) sum_t w_t log pi(x_t) = 0.85 x the plain policy-gradient one: the teacher pulls the
    tokens it finds less likely down, against the advantage, with weight coef."""
    from ajet.backbones.debug.backbone import _collate, token_logprobs

    bb = _backbone(tiny_model_dir, distill={"teacher": shifted_teacher, "mode": "add", "coef": 0.5})
    try:
        samples = _on_policy(bb, _two_episodes(inf_token=False))
        bb.model.zero_grad()
        stats = bb.accumulate_gradients(samples)
        g_add = torch.cat([p.grad.flatten() for p in bb.model.parameters() if p.grad is not None])
        bb.model.zero_grad()
        batch = _collate(samples, [1 / 8, 1 / 8], bb.tokenizer.pad_token_id, bb.device)   # -sum_t w_t log pi(x_t)
        lp, _ = token_logprobs(bb.model, batch["input_ids"], batch["attention_mask"], batch["temperatures"])
        (-(batch["weights"] * lp).sum()).backward()
        g_pg = torch.cat([p.grad.flatten() for p in bb.model.parameters() if p.grad is not None])
        bb.model.zero_grad()
    finally:
        bb.close()
    assert stats["pg_loss"] == pytest.approx(-1.0, abs=1e-5)
    assert stats["distill/kl"] == pytest.approx(0.3, abs=1e-5)
    assert stats["loss"] == pytest.approx(-0.85, abs=1e-5)
    assert g_pg.norm() > 0
    assert ((g_add - 0.85 * g_pg).norm() / g_pg.norm()).item() < 1e-4


def test_a_token_the_url_teacher_gives_minus_infinity_adds_no_distill_term(tiny_model_dir, shifted_teacher):
    """As above, with the last token of the second episode at -inf under the teacher (vLLM's -9999.0): that token
    has no distillation term, so distill/kl = 0.3 * 7/8 = 0.2625 and loss = -1 + 0.5 * 0.2625 = -0.86875 (by hand);
    read as -9999 it would add ~1250 nats to distill/kl."""
    bb = _backbone(tiny_model_dir, distill={"teacher": shifted_teacher, "mode": "add", "coef": 0.5})
    try:
        stats = bb.accumulate_gradients(_on_policy(bb, _two_episodes(inf_token=True)))
        bb.model.zero_grad()
    finally:
        bb.close()
    assert stats["distill/kl"] == pytest.approx(0.2625, abs=1e-5)
    assert stats["loss"] == pytest.approx(-0.86875, abs=1e-5)


def test_a_url_teacher_warns_at_startup_when_the_rollout_temperature_is_not_1(tiny_model_dir, teacher, caplog):
    """The server's prompt logprobs are at temperature 1: with rollout.temperature 0.7 the backbone says so once,
    naming both temperatures and what the KL is then to; at temperature 1 and top_p 1 it says nothing."""
    import logging

    from ajet.backbones.debug.backbone import DebugBackbone
    from ajet.config import AjetConfig

    _, _, url, _ = teacher
    for temperature, warned in ((0.7, True), (1.0, False)):
        caplog.clear()
        cfg = AjetConfig(workflow="x:y", data={"train_path": "x"}, model={"path": tiny_model_dir, "device": "cpu"},
                         rollout={"temperature": temperature}, algorithm={"distill": {"teacher": url}})
        with caplog.at_level(logging.WARNING, logger="ajet.backbones.debug.backbone"):
            DebugBackbone(cfg).close()
        messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        if not warned:
            assert not [m for m in messages if "temperature" in m]
            continue
        (message,) = [m for m in messages if "temperature" in m]
        assert "rollout.temperature 0.7" in message and "temperature 1" in message
        assert "KL from the student at temperature 0.7 to the teacher at temperature 1" in message
