"""tools/soak.py: one short run of each engine fuzz passes, and a run whose engine leaks
blocks fails (the soak's checks can fail)."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

_PATH = pathlib.Path(__file__).resolve().parents[1] / "tools" / "soak.py"
_spec = importlib.util.spec_from_file_location("kvplan_soak_tool", _PATH)
soak = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(soak)


def test_dense_runs_pass(capsys):
    assert soak.main(["dense", "--runs", "2", "--ops", "30", "--seed", "1000"]) == 0
    out = capsys.readouterr().out
    assert out.count("ok seed=") == 2 and "dense: 2 runs, 0 failed" in out


def test_hybrid_run_passes(capsys):
    assert soak.main(["hybrid", "--runs", "1", "--ops", "30", "--seed", "7"]) == 0
    assert "hybrid: 1 runs, 0 failed" in capsys.readouterr().out


def test_a_leaking_engine_fails(monkeypatch, capsys):
    from kvplan.cache.kv_cache_manager import KVCacheManager

    real_free = KVCacheManager.free
    freed = []

    def leaky_free(self, request_id):  # every third request keeps its blocks
        freed.append(request_id)
        if len(freed) % 3:
            real_free(self, request_id)

    monkeypatch.setattr(KVCacheManager, "free", leaky_free)
    with pytest.raises(AssertionError):
        soak.run_dense(1001, ops=60)
    assert soak.main(["dense", "--runs", "1", "--ops", "60", "--seed", "1001"]) == 1
    assert "FAIL seed=1001" in capsys.readouterr().out


def test_structured_runs_pass_and_a_broken_guide_fails(monkeypatch, capsys):
    assert soak.main(["structured", "--runs", "2", "--ops", "12", "--seed", "5"]) == 0
    assert "structured: 2 runs, 0 failed" in capsys.readouterr().out
    from kvplan.engine.json_mode import JsonGuide

    monkeypatch.setattr(
        JsonGuide, "mask", lambda self, vocab: __import__("numpy").ones(vocab, bool)
    )
    assert soak.main(["structured", "--runs", "1", "--ops", "12", "--seed", "5"]) == 1
    assert "FAIL seed=5" in capsys.readouterr().out
