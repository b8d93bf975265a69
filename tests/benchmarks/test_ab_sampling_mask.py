"""benchmarks/ab_sampling_mask.py: arm names with their extra environment, and the arms' order in each round."""

from __future__ import annotations

import os
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))
import ab_sampling_mask as ab  # noqa: E402

# A third arm: the mask arm with another attention backend (its extra environment, a variable of vllm/envs.py).
ALT = "mask+VLLM_ATTENTION_BACKEND=TORCH"


def test_arm_names_with_extra_environment() -> None:
    import pytest

    assert ab.arm_spec("mask") == (["--return-sampling-mask"], {})
    assert ab.arm_spec("mask+VLLM_ATTENTION_BACKEND=TORCH+VLLM_MAX_N_SEQUENCES=64") == (
        ["--return-sampling-mask"], {"VLLM_ATTENTION_BACKEND": "TORCH", "VLLM_MAX_N_SEQUENCES": "64"})
    assert ab.ARMS["mask"][1] == {}  # not changed by the call above
    assert ab.arm_spec("mask+VLLM_ATTENTION_BACKEND=a+b")[1] == {"VLLM_ATTENTION_BACKEND": "a+b"}  # "+" in a value
    for bad in ("masks", "pre-change", "mask+FOO=1", "mask+VLLM_ATTENTION_BACKEND", "no-mask+",
                "mask+VLLM_NO_SUCH_VAR=1"):
        with pytest.raises(ValueError):
            ab.arm_spec(bad)
    assert ab.arm_file_name("mask+VLLM_X=0.5") == "mask_VLLM_X_0.5"


def test_arm_request_fields_go_into_every_request_body_of_that_arm() -> None:
    arm = "mask+VLLM_ATTENTION_BACKEND=TORCH@presence_penalty=0.5@repetition_penalty=1.1"
    assert ab.arm_spec(arm) == (["--return-sampling-mask"], {"VLLM_ATTENTION_BACKEND": "TORCH"})
    assert ab.arm_body(arm) == {"presence_penalty": 0.5, "repetition_penalty": 1.1}
    assert ab.arm_body("mask") == {}
    args = ab.make_parser().parse_args(["--arms", "mask", arm])
    load = ab.load_args(args, "http://x", 64, 10.0, ab.arm_body(arm))
    payload = ab.benchmark_serving.build_payload(load, "m", 8)
    assert payload["presence_penalty"] == 0.5 and payload["repetition_penalty"] == 1.1
    assert "presence_penalty" not in ab.benchmark_serving.build_payload(ab.load_args(args, "http://x", 64, 10.0),
                                                                       "m", 8)
    for bad in ("mask@presence_penalty", "mask@x=nope", "mask@=1"):
        with pytest.raises(ValueError):
            ab.arm_body(bad)


def test_round_order_reverses_and_keeps_a_lead_arm_first() -> None:
    arms = ["no-mask", "mask", ALT]
    assert [ab.round_order(arms, r) for r in range(3)] == [arms, arms[::-1], arms]
    led = [ab.round_order(arms, r, ALT) for r in range(2)]
    assert led == [[ALT, "no-mask", "mask"], [ALT, "mask", "no-mask"]]
    # Each of the other arms follows the lead arm in one round and the other arm in the other.
    followers = {tuple(o[i:i + 2]) for o in led for i in range(2)}
    assert (ALT, "no-mask") in followers and (ALT, "mask") in followers


def test_arm_level_timeout_overrides_the_level_timeout_of_one_arm() -> None:
    import pytest

    parser = ab.make_parser()
    args = parser.parse_args(["--level-timeout", "16", "--arm-level-timeout", f"{ALT}=8",
                              "--arm-level-timeout", "mask+VLLM_MAX_N_SEQUENCES=64=12.5"])
    assert ab.arm_level_timeout(args, ALT) == 8.0
    assert ab.arm_level_timeout(args, "mask+VLLM_MAX_N_SEQUENCES=64") == 12.5  # "=" inside the arm name
    assert ab.arm_level_timeout(args, "mask") == 16.0 and ab.arm_level_timeout(args, "no-mask") == 16.0
    for bad in ("mask", "mask=", "=8", "mask=soon", "mask=2", "masks=8"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--arm-level-timeout", bad])


def test_arm_level_timeout_of_an_arm_not_run_is_refused(monkeypatch, capsys) -> None:  # noqa: ANN001
    import pytest

    monkeypatch.setattr(sys, "argv", ["ab_sampling_mask.py", "--arms", "no-mask", "mask",
                                      "--arm-level-timeout", f"{ALT}=8", "--out-dir", "/nonexistent/ab"])
    with pytest.raises(SystemExit):
        ab.main()
    assert f"--arm-level-timeout: '{ALT}' is not one of --arms" in capsys.readouterr().err


def test_one_server_is_primed_before_the_first_arm(monkeypatch, tmp_path) -> None:  # noqa: ANN001
    """Before the rounds, one server of the first arm (the lead arm when there is one) is started and stopped, and
    its start-up time recorded; --no-prime skips it. Servers and levels are stand-ins here."""
    import json

    events: list[tuple[str, str]] = []

    class _Proc:
        pid = 0

    def fake_start(args, arm, port, log_path):  # noqa: ANN001, ANN202
        events.append(("start", arm))
        return _Proc()

    def fake_run_arm(args, arm, arm_deadline, log_suffix=""):  # noqa: ANN001, ANN202
        events.append(("arm", arm))
        return {"arm": arm, "error": None, "levels": []}

    monkeypatch.setattr(ab, "start_server", fake_start)
    monkeypatch.setattr(ab, "wait_healthy", lambda proc, url, timeout_s: None)
    monkeypatch.setattr(ab, "stop_server", lambda proc: events.append(("stop", "")))
    monkeypatch.setattr(ab, "run_arm", fake_run_arm)
    monkeypatch.setattr(ab, "plot", lambda *a, **k: None)
    for extra, want in (([], [("start", ALT), ("stop", "")]), (["--no-prime"], [])):
        events.clear()
        out = tmp_path / ("noprime" if extra else "prime")
        monkeypatch.setattr(sys, "argv", ["ab_sampling_mask.py", "--arms", "no-mask", "mask", ALT,
                                          "--lead-arm", ALT, "--concurrencies", "4", "--out-dir", str(out),
                                          *extra])
        ab.main()
        assert events == [*want, ("arm", ALT), ("arm", "no-mask"), ("arm", "mask")]
        prime_s = json.loads((out / "ab_sampling_mask.json").read_text())["prime_startup_s"]
        assert (prime_s is None) == bool(extra)


def test_arm_rounds_runs_one_arm_in_the_last_rounds_only(monkeypatch, tmp_path, capsys) -> None:  # noqa: ANN001
    """--arm-rounds ARM=1: that arm runs once, at the very end
    (the last round), the others in all three rounds (order still alternating); each run gets an equal share of
    the budget left over the runs left (7 runs, not 9); its medians are its one round's."""
    import json

    import pytest

    runs: list[tuple[str, str, float]] = []
    clock = [1000.0]
    monkeypatch.setattr(ab.time, "monotonic", lambda: clock[0])

    def fake_run_arm(args, arm, arm_deadline, log_suffix=""):  # noqa: ANN001, ANN202
        runs.append((arm, log_suffix, arm_deadline - clock[0]))
        clock[0] = arm_deadline  # each run takes its whole share
        return {"arm": arm, "error": None, "server_log": f"{arm}{log_suffix}.log",
                "levels": [{"concurrency": 4, "output_throughput": 100.0 + len(runs), "truncated": False,
                            "masks_ok": None, "ttft_ms_median": 1.0, "tpot_ms_median": 1.0}]}

    monkeypatch.setattr(ab, "run_arm", fake_run_arm)
    monkeypatch.setattr(ab, "plot", lambda *a, **k: None)
    argv = ["ab_sampling_mask.py", "--arms", "no-mask", "mask", ALT, "--rounds", "3", "--arm-rounds",
            f"{ALT}=1", "--concurrencies", "4", "--budget-s", "140", "--no-prime", "--out-dir", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", argv)
    ab.main()
    assert [(arm, suffix) for arm, suffix, _ in runs] == [
        ("no-mask", "_r1"), ("mask", "_r1"), ("mask", "_r2"), ("no-mask", "_r2"),
        ("no-mask", "_r3"), ("mask", "_r3"), (ALT, "_r3")]
    assert [share for _, _, share in runs] == [pytest.approx(20.0)] * 7  # 140 / 7, then 120 / 6, ...
    result = json.loads((tmp_path / "ab_sampling_mask.json").read_text())
    assert [a["arm"] for a in result["arms"]] == ["no-mask", "mask", ALT]
    pre = result["arms"][2]
    assert pre["levels"][0]["round_throughputs"] == [107.0]  # its one round
    assert result["arms"][1]["levels"][0]["round_throughputs"] == [102.0, 103.0, 106.0]
    table = (tmp_path / "ab_sampling_mask.md").read_text()
    # Medians 104 / 103 / 107; per round mask and the third arm over no mask, then the medians of those.
    assert "| 4 | 104 (1 / 1.0) | 103 (1 / 1.0) | 107 (1 / 1.0) | 0.990 | 1.029 |" in table
    assert f"Medians over 3 rounds ({ALT} in 1 of them)" in table
    assert "- c=4: 1.010 -, 0.990 -, 1.010 1.019 [1.010 1.019]" in table
    for bad, message in ((["--arm-rounds", f"{ALT}=4"], "is more than --rounds 3"),
                         (["--arm-rounds", f"{ALT}=0"], "expected ARM=ROUNDS"),
                         (["--arm-rounds", "mask+VLLM_MAX_N_SEQUENCES=64=1"], "is not one of --arms"),
                         (["--arm-rounds", "no-mask=2"], "no-mask is the baseline")):
        monkeypatch.setattr(sys, "argv", [*argv, *bad])
        capsys.readouterr()
        with pytest.raises(SystemExit):
            ab.main()
        assert message in capsys.readouterr().err


def test_paths_run_per_arm_and_become_columns(monkeypatch, tmp_path) -> None:  # noqa: ANN001
    """--paths stream generate chat offline: per arm one server for the streamed and generate levels, one with the
    synthetic tokenizer for chat, and the offline run; each path a column ARM#PATH compared with no-mask#PATH."""
    import json

    runs: list[tuple[str, list[str] | None, str | None]] = []

    def fake_run_arm(args, arm, arm_deadline, log_suffix="", paths=None, tokenizer=None):  # noqa: ANN001, ANN202
        runs.append((arm, paths, tokenizer and os.path.basename(tokenizer)))
        base = 100.0 if arm == "no-mask" else 99.0
        return {"arm": arm, "error": None, "server_log": "x.log",
                "levels": [{"concurrency": 4, "path": p, "output_throughput": base + i, "truncated": False,
                            "masks_ok": None, "ttft_ms_median": 1.0, "tpot_ms_median": 1.0}
                           for i, p in enumerate(paths or ["stream"])]}

    def fake_offline(args, arm, arm_deadline, log_suffix=""):  # noqa: ANN001, ANN202
        runs.append((arm, ["offline"], None))
        return {"arm": arm, "error": None, "server_log": "o.log",
                "levels": [{"concurrency": 4, "path": "offline", "output_throughput": 50.0 if arm == "no-mask" else 49.0,
                            "truncated": False, "masks_ok": None, "ttft_ms_median": None, "tpot_ms_median": None}]}

    monkeypatch.setattr(ab, "run_arm", fake_run_arm)
    monkeypatch.setattr(ab, "run_offline", fake_offline)
    monkeypatch.setattr(ab, "plot", lambda *a, **k: None)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 40}))
    monkeypatch.setattr(sys, "argv", ["ab_sampling_mask.py", "--arms", "no-mask", "mask", "--paths", "stream",
                                      "generate", "chat", "offline", "--concurrencies", "4", "--no-prime",
                                      "--model", str(model), "--out-dir", str(tmp_path / "out")])
    ab.main()
    assert runs == [("no-mask", ["stream", "generate"], None), ("no-mask", ["chat"], "id_tokenizer"),
                    ("no-mask", ["offline"], None), ("mask", ["stream", "generate"], None),
                    ("mask", ["chat"], "id_tokenizer"), ("mask", ["offline"], None)]
    result = json.loads((tmp_path / "out" / "ab_sampling_mask.json").read_text())
    assert [a["arm"] for a in result["arms"]] == ["no-mask", "no-mask#generate", "no-mask#chat", "no-mask#offline",
                                                  "mask", "mask#generate", "mask#chat", "mask#offline"]
    table = (tmp_path / "out" / "ab_sampling_mask.md").read_text()
    # 99 / 100 (stream), 100 / 101 (generate), 99 / 100 (chat, its own server's first path), 49 / 50 (offline).
    assert "| 0.990 | 0.990 | 0.990 | 0.980 |" in table


def test_id_tokenizer_reads_and_writes_ids_as_words(tmp_path) -> None:  # noqa: ANN001
    """The chat path's synthetic tokenizer: "<5><17>" is [5, 17] through encode and through the chat template,
    and every id decodes back to its word, pieces and whole alike."""
    from vllm.transformers_utils.tokenizer import get_tokenizer

    tok = get_tokenizer(ab.write_id_tokenizer(str(tmp_path / "tok"), 1000))
    assert tok.encode("<5><17><999>", add_special_tokens=False) == [5, 17, 999]
    rendered = tok.apply_chat_template([{"role": "user", "content": "<5><17>"}], tokenize=False,
                                       add_generation_prompt=True)
    assert tok.encode(rendered, add_special_tokens=False) == [5, 17]
    assert tok.decode([5, 17, 999]) == "<5><17><999>" == tok.decode([5]) + tok.decode([17]) + tok.decode([999])
