"""A real ``kvplan serve`` app on a free localhost port (uvicorn in a thread) over a tiny
random Llama folder with a word-level tokenizer, plus a reference `LLM` on the same folder."""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

# the server tests need the serve and test extras
_NEEDED = ("fastapi", "uvicorn", "openai", "httpx")
collect_ignore_glob = [] if all(importlib.util.find_spec(m) for m in _NEEDED) else ["test_*.py"]


ENGINE = dict(device="cpu", block_size=8, max_num_seqs=64, max_model_len=1024, num_blocks=1200)


class Served:
    def __init__(self, llm, ref, server, thread, url):
        self.llm, self.ref, self.server, self.thread, self.url = llm, ref, server, thread, url
        self.app = server.config.app
        self.engine = self.app.state.engine

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Until the engine holds no request (every block free) or ``timeout``."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.engine.num_live == 0 and not self.llm.engine.has_unfinished():
                return
            time.sleep(0.01)

    def all_blocks_free(self) -> bool:
        m = self.llm.parts.manager
        return m.num_requests == 0 and m.num_free_blocks() == self.llm.parts.num_blocks - 1


@pytest.fixture(scope="session")
def served(tmp_path_factory):
    import uvicorn
    from server_testlib import API_KEY, make_model_folder

    from kvplan.engine.llm import LLM
    from kvplan.server.app import build_app

    torch.set_num_threads(1)
    folder = make_model_folder(tmp_path_factory.mktemp("tiny") / "tiny-llama")
    llm = LLM(str(folder), chat_template=False, **ENGINE)
    ref = LLM(str(folder), chat_template=False, **ENGINE)
    app = build_app(llm, api_key=API_KEY)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    end = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < end, "the server did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    served = Served(llm, ref, server, thread, f"http://127.0.0.1:{port}")
    served.model_dir = folder
    yield served
    server.should_exit = True
    thread.join(10)
