"""The benchmarks stay runnable: tiny sizes, figures present and positive (no speed asserted here)."""


def test_handoff_bench_reports_both_figures(tmp_path, capsys):
    from rltools.bench.handoff import run_handoff_bench

    result = run_handoff_bench(repeats=2, directory=str(tmp_path), prompts=4, group=2)
    assert result["ours_mb_s"] > 0 and result["reference_mb_s"] > 0
    assert abs(result["ratio"] - result["ours_mb_s"] / result["reference_mb_s"]) < 0.01
    assert 0 < result["p50_visible_s"] < 60
    assert list(tmp_path.iterdir()) == []  # the bench cleans up after itself
