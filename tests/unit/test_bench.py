"""The benchmarks stay runnable: tiny sizes, figures present and positive (no speed asserted here)."""


def test_handoff_bench_reports_both_figures(tmp_path, capsys):
    from rltools.bench.handoff import run_handoff_bench

    result = run_handoff_bench(repeats=2, directory=str(tmp_path), prompts=4, group=2)
    assert result["ours_mb_s"] > 0 and result["reference_mb_s"] > 0
    ours, reference = result["ours_mb_s"], result["reference_mb_s"]
    rounding = 0.05 / reference * (1 + ours / reference) + 0.0005  # the MB/s figures are printed to 0.1
    assert abs(result["ratio"] - ours / reference) <= rounding
    assert 0 < result["p50_visible_s"] < 60
    assert list(tmp_path.iterdir()) == []  # the bench cleans up after itself
