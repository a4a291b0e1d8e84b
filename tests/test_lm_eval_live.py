"""lm-eval, live, against a real server given only `base_url` and `model` (issue 41, item 2).

`lm_eval --model local-completions` finds vLLM's tokenizer routes by itself (GET /tokenizer_info,
POST /tokenize), then scores a multiple-choice task by log-likelihood (token-id prompts with `echo`
and `logprobs`) and runs a generate_until task; `lm_eval --model local-chat-completions
--apply_chat_template` runs the same generate_until task through /v1/chat/completions (the server
applies the model's chat template). No `tokenizer=` argument anywhere.

lm-eval runs as its own CLI from its own virtual environment (`make test` builds .venv-lmeval; the
Makefile says why it is not in the dev extra). That environment has neither transformers nor
tokenizers: whatever lm-eval tokenized, the server tokenized. The tasks are local (a JSONL file in
tests/fixtures/lm_eval through `dataset_path: json`) and the Hub is off (HF_HUB_OFFLINE,
HF_DATASETS_OFFLINE). What lm-eval reports is checked against transformers' own forward of the
demo checkpoint: each choice's log-likelihood and greediness, and each greedy answer; and the
server's own record of the requests it answered shows the tokenizer routes lm-eval asked for.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoTokenizer

import mmserve.api.server as server_module
from mmserve.config import Config, ModelConfig
from tests.conftest import _demo_dir, on_device
from tests.helpers import ServerThread

ROOT = Path(__file__).resolve().parent.parent
TASKS = ROOT / "tests" / "fixtures" / "lm_eval"
DOCS = [json.loads(line) for line in (TASKS / "colours.jsonl").read_text().splitlines() if line.strip()]
CHOICES = sum(len(doc["choices"]) for doc in DOCS)  # the multiple-choice task: a log-likelihood a choice
MAX_GEN_TOKS = 8  # mmserve_colours_gen.yaml's generation_kwargs


@pytest.fixture(scope="module")
def lm_eval_command() -> str:
    """`make test` names the command in MMSERVE_LM_EVAL: named, it must exist (a missing environment
    fails, never skips). Unnamed (a test file run by hand), the worktree's .venv-lmeval, else a skip."""
    named = os.environ.get("MMSERVE_LM_EVAL")
    if named:
        assert Path(named).is_file(), f"MMSERVE_LM_EVAL={named} does not exist: run `make install-lm-eval`"
        return named
    local = ROOT / ".venv-lmeval" / "bin" / "lm_eval"
    if not local.is_file():
        pytest.skip("lm-eval's environment is not built: `make install-lm-eval` (make test builds it)")
    return str(local)


@pytest.fixture(scope="module")
def served():
    """A server of the demo model, and the list of (method, path, status) of every HTTP request it
    answered: its app is the real one, wrapped only to write down what it answers."""
    answered: list[tuple[str, str, int]] = []
    real_create_app = server_module.create_app

    def recording_app(rt):
        app = real_create_app(rt)

        async def asgi(scope, receive, send):
            if scope["type"] != "http":
                return await app(scope, receive, send)

            async def send_and_record(message):
                if message["type"] == "http.response.start":
                    answered.append((scope["method"], scope["path"], message["status"]))
                await send(message)
            return await app(scope, receive, send_and_record)
        return asgi

    config = on_device(Config(models=(ModelConfig("demo", _demo_dir("demo"), default=True),)))
    server = ServerThread(config)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(server_module, "create_app", recording_app)
        server.__enter__()  # the app is made before the socket opens: the patch ends once it listens
    try:
        yield server, answered
    finally:
        server.__exit__(None, None, None)


def start_lm_eval(command: str, model: str, base_url: str, tasks: str, out: Path, *extra: str) -> subprocess.Popen:
    """`lm_eval` with only base_url and model, from the tasks' folder (their data_files are relative),
    offline: nothing may reach the Hub, and its caches go to `out`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "PYTHON", "OPENAI_", "TRANSFORMERS_"))}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_EVALUATE_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_HOME=str(out / "hf-home"), TQDM_DISABLE="1")
    argv = [command, "--model", model, "--model_args", f"base_url={base_url},model=demo", "--tasks", tasks,
            "--include_path", ".", "--output_path", str(out / "results"), "--log_samples", *extra]
    return subprocess.Popen(argv, cwd=TASKS, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def finished(proc: subprocess.Popen) -> str:
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-6000:]
    return output


@contextmanager
def killed_on_exit(*procs: subprocess.Popen):
    """The processes, killed if any is still running when the block ends (a failure or a time-out)."""
    try:
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def results_and_samples(out: Path) -> tuple[dict, dict[str, dict[int, dict]]]:
    """lm-eval's results file and its logged samples, task -> doc_id -> sample."""
    (results,) = (out / "results").rglob("results_*.json")
    samples = {}
    for path in (out / "results").rglob("samples_*.jsonl"):
        task = path.name.removeprefix("samples_").rsplit("_", 1)[0]
        samples[task] = {s["doc_id"]: s for s in map(json.loads, path.read_text().splitlines())}
    return json.loads(results.read_text()), samples


@pytest.fixture(scope="module")
def runs(lm_eval_command, served, tmp_path_factory):
    """Both lm-eval runs, at once (each spends most of its time indexing lm-eval's own task YAMLs,
    on one core): their outputs and result folders. (lm_eval_command first: a skip starts no server.)"""
    server, _ = served
    command = lm_eval_command
    completions_out, chat_out = tmp_path_factory.mktemp("lm-eval-completions"), tmp_path_factory.mktemp("lm-eval-chat")
    completions = start_lm_eval(command, "local-completions", server.url + "/v1/completions",
                                "mmserve_colours_mc,mmserve_colours_gen", completions_out)
    chat = start_lm_eval(command, "local-chat-completions", server.url + "/v1/chat/completions",
                         "mmserve_colours_gen", chat_out, "--apply_chat_template")
    with killed_on_exit(completions, chat):
        return {"local-completions": (finished(completions), completions_out),
                "local-chat-completions": (finished(chat), chat_out)}


@pytest.fixture(scope="module")
def hf():
    """transformers' own tokenizer and model of the demo checkpoint (fp32), the reference."""
    tokenizer = AutoTokenizer.from_pretrained(_demo_dir("demo"))
    model = AutoModelForImageTextToText.from_pretrained(_demo_dir("demo"), dtype=torch.float32).eval()
    return tokenizer, model


def hf_log_softmax(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)


def hf_greedy(tokenizer, model, ids: list[int], stop: str) -> str:
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=MAX_GEN_TOKS, do_sample=False)
    return tokenizer.decode(out[0, len(ids):], skip_special_tokens=True).split(stop)[0]


def test_local_completions_uses_the_servers_tokenizer_and_scores_as_transformers(runs, hf):
    output, out = runs["local-completions"]
    # lm-eval's own word that it found the routes and uses them (no tokenizer= was given)
    assert "Auto-detected remote tokenizer support" in output and "Using tokenizer remote" in output, output[-3000:]
    results, samples = results_and_samples(out)
    for task, metric in (("mmserve_colours_mc", "acc,none"), ("mmserve_colours_gen", "exact_match,none")):
        assert results["n-samples"][task]["effective"] == len(DOCS) and len(samples[task]) == len(DOCS)
        assert 0 <= results["results"][task][metric] <= 1

    tokenizer, model = hf
    for doc_id, sample in samples["mmserve_colours_mc"].items():
        assert len(sample["resps"]) == len(DOCS[doc_id]["choices"]), sample
        for (context, continuation), [(loglikelihood, greedy)] in zip(
                ([a["arg_0"], a["arg_1"]] for a in sample["arguments"].values()), sample["resps"]):
            # lm-eval's split (api/model.py _encode_pair): the whole text's tokens, the context's first
            whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
            ctxlen = len(tokenizer(context, add_special_tokens=False)["input_ids"])
            lp = hf_log_softmax(model, whole)
            want = sum(lp[j - 1, whole[j]].item() for j in range(ctxlen, len(whole)))
            assert math.isfinite(float(loglikelihood)) and float(loglikelihood) == pytest.approx(want, abs=1e-3), \
                (doc_id, continuation)
            want_greedy = all(lp[j - 1].argmax().item() == whole[j] for j in range(ctxlen, len(whole)))
            assert greedy == str(want_greedy), (doc_id, continuation)

    for doc_id, sample in samples["mmserve_colours_gen"].items():
        context, kwargs = sample["arguments"]["gen_args_0"]["arg_0"], sample["arguments"]["gen_args_0"]["arg_1"]
        assert kwargs["until"] == ["\n"] and kwargs["max_gen_toks"] == MAX_GEN_TOKS
        ids = tokenizer(context, add_special_tokens=False)["input_ids"]
        want = hf_greedy(tokenizer, model, ids, "\n")
        assert sample["resps"] == [[want]] and want.strip(), doc_id


def test_local_chat_completions_gets_the_chat_templates_answers(runs, hf):
    output, out = runs["local-chat-completions"]
    results, samples = results_and_samples(out)
    assert results["n-samples"]["mmserve_colours_gen"]["effective"] == len(DOCS)
    tokenizer, model = hf
    for doc_id, sample in samples["mmserve_colours_gen"].items():
        (chat,) = sample["arguments"]["gen_args_0"]["arg_0"]  # --apply_chat_template: the messages, as JSON
        messages = json.loads(chat)
        assert messages[-1]["role"] == "user", messages
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        # the chat path strips the template's lead (" ") from the answer, as tests/test_completions.py shows
        want = hf_greedy(tokenizer, model, ids, "\n").strip()
        assert sample["resps"] == [[want]] and want, doc_id


def test_the_server_answered_the_tokenizer_routes_lm_eval_asked_for(runs, served):
    _, answered = served
    refused = [a for a in answered if a[2] != 200]
    assert not refused, refused
    asked = {(method, path) for method, path, _ in answered}
    assert {("GET", "/tokenizer_info"), ("POST", "/tokenize")} <= asked, asked
    count = lambda path: sum(1 for _, p, _ in answered if p == path)  # noqa: E731
    # one request a choice (log-likelihood) and one a doc (generation); the chat run: one a doc
    assert count("/v1/completions") == CHOICES + len(DOCS) and count("/v1/chat/completions") == len(DOCS)
    assert count("/tokenize") >= CHOICES  # every context and continuation, tokenized by the server
