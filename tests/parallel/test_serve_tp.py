"""The server over a TP 2 engine (its loop steps the engine in a thread): the same completion as one process."""

import json
import urllib.request

import pytest
import torch

from kvstate.llm import LLM
from kvstate.engine.params import SamplingParams
from tests.live_server import ServerThread
from tests.models.test_tokenizer import write_tokenizer
from tests.parallel.checkpoints import save_tiny

PROMPT = [5, 9, 13, 27, 31, 44, 45]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp") / "dense"
    save_tiny("dense", path, vocab=300)
    write_tokenizer(path)
    return str(path)


def test_served_tp2_completion_equals_one_process(checkpoint):
    from kvstate.server.app import create_app

    torch.set_num_threads(1)
    alone = LLM(checkpoint, cache_memory="8MiB").generate([PROMPT], SamplingParams(temperature=0, max_tokens=6,
                                                                                    ignore_eos=True))[0]
    llm = LLM(checkpoint, cache_memory="8MiB", tensor_parallel_size=2)
    try:
        with ServerThread(create_app(llm, model_name="tiny")) as url:
            body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                               "ignore_eos": True}).encode()
            req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                out = json.loads(r.read())
        assert out["choices"][0]["text"] == alone.outputs[0].text and out["usage"]["completion_tokens"] == 6
    finally:
        llm.close()
        llm.close()  # once is enough: a second close returns at once
