"""`hybridflow report`: reading run directories, the HTML of two CPU runs, its screenshot."""

import base64
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hybridflow.install_hint import extra_install

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer"))
from trainer_helpers import tiny_config  # noqa: E402

from hybridflow.cli import main
from hybridflow.report.runs import config_differences, parse_metrics, read_run

matplotlib = pytest.importorskip("matplotlib", reason="the report needs hybridflow[report]")
from hybridflow.report.plots import PLOTS  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_metrics_of_a_run_still_going_skip_the_cut_line_and_merge_steps():
    lines = [
        '{"step": 0, "val/a/mean@4": 0.25}',
        '{"step": 1, "reward/mean": 0.5}',
        '{"step": 0, "timing_s/validation": 3.0}',
        "[1, 2]",
        '{"step": 2, "reward/me',  # being written
    ]
    steps, skipped = parse_metrics(lines)
    assert steps == {0: {"val/a/mean@4": 0.25, "timing_s/validation": 3.0}, 1: {"reward/mean": 0.5}}
    assert skipped == 2


def test_config_differences_name_the_dotted_keys_that_differ():
    a = {"actor": {"lr": 1e-6, "betas": [0.9, 0.99]}, "data": {"shuffle": True}}
    b = {"actor": {"lr": 2e-6, "betas": [0.9, 0.99]}, "data": {"shuffle": True, "extra": 1}}
    assert config_differences([a, b, None]) == {"actor.lr": [1e-6, 2e-6], "data.extra": [None, 1]}
    assert config_differences([a]) == {}


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Two 2-step CPU runs that differ in actor.lr (a few seconds each)."""
    from hybridflow.progress import quiet_reporter
    from hybridflow.trainer.lifecycle.run import train

    root = tmp_path_factory.mktemp("runs")
    dirs = []
    for name, lr in (("base", "2e-4"), ("high_lr", "2e-3")):
        cfg = tiny_config(root / name, f"actor.lr={lr}", "trainer.save_freq=-1")
        train(cfg, log=lambda *args: None, progress=quiet_reporter())
        dirs.append(root / name / "run")
    return dirs


def test_report_of_two_runs_writes_one_html_with_every_plot(two_runs, capsys):
    assert main(["report", *map(str, two_runs)]) == 0
    out = two_runs[0] / "report.html"  # the default: beside the first run's metrics
    page = out.read_text()
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert len(images) == len(PLOTS)
    for plot, data in zip(PLOTS, images):
        assert f'id="{plot.slug}"' in page
        png = (two_runs[0] / f"report-{plot.slug}.png").read_bytes()
        assert png.startswith(PNG_SIGNATURE) and base64.b64decode(data) == png
    assert "base/run" in page and "high_lr/run" in page  # both runs, told apart
    assert re.search(r"<td>actor.lr</td><td>0.0002</td><td>0.002</td>", page)
    assert "wrote" in capsys.readouterr().out


def test_report_of_a_run_that_is_still_going(tmp_path):
    run = tmp_path / "live"
    run.mkdir()
    rows = [{"step": 1, "reward/mean": 0.1, "timing_s/gen": 1.0, "timing_s/step": 1.5}]
    (run / "metrics.jsonl").write_text(json.dumps(rows[0]) + '\n{"step": 2, "rew')
    assert read_run(run).notes == ["no config.yaml: its config is not shown"]
    out = tmp_path / "out" / "live.html"
    assert main(["report", str(run), "--out", str(out)]) == 0
    page = out.read_text()
    assert "1 unreadable line(s) skipped" in page and "not logged" not in page[:200]
    assert (tmp_path / "out" / "live-timing.png").is_file()


def test_report_names_a_bad_directory_or_out_file(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nowhere")]) == 2
    assert "nowhere: no such directory" in capsys.readouterr().err
    assert main(["report", str(tmp_path)]) == 2
    assert "no metrics.jsonl; is this a run directory" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "r.png")]) == 2
    assert "give a file name ending in .html" in capsys.readouterr().err


def chromium() -> str | None:
    return next(
        (shutil.which(n) for n in ("chromium", "chromium-browser") if shutil.which(n)), None
    )


def test_report_renders_in_headless_chromium(two_runs, tmp_path):
    browser = chromium()
    if browser is None:
        pytest.skip("chromium is not installed (apt-get install chromium): screenshot not checked")
    out = tmp_path / "report.html"
    assert main(["report", *map(str, two_runs), "--out", str(out)]) == 0
    shot = tmp_path / "shot.png"
    subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         f"--screenshot={shot}", "--window-size=1200,1400", out.as_uri()],
        capture_output=True, timeout=120, check=True,
    )  # fmt: skip
    pixels = matplotlib.image.imread(shot)[..., :3]  # [H, W, 3] in [0, 1]
    not_white = (pixels < 0.9).any(axis=-1).mean()
    # the two runs' line colours (plots.RUN_COLORS: blue #1f77b4, red #d62728) are drawn
    blue = ((pixels[..., 2] > 0.6) & (pixels[..., 0] < 0.3)).sum()
    red = ((pixels[..., 0] > 0.7) & (pixels[..., 1] < 0.3) & (pixels[..., 2] < 0.3)).sum()
    assert not_white > 0.03 and blue > 100 and red > 100, (not_white, blue, red)


def test_report_without_matplotlib_says_what_to_install(tmp_path, monkeypatch, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n')
    for module in ("hybridflow.report.page", "hybridflow.report.plots"):
        monkeypatch.delitem(sys.modules, module, raising=False)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # not installed
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert extra_install("report") in err and "Traceback" not in err


def test_band_is_mean_plus_minus_std_else_min_to_max():
    from hybridflow.report.plots import REWARD_PANELS, band_of
    from hybridflow.report.runs import Run

    panel = REWARD_PANELS[0]
    with_std = Run("a", Path("."), {1: {"reward/mean": 0.5, "reward/std": 0.1}})
    without = Run("b", Path("."), {1: {"reward/mean": 0.5, "reward/min": 0.0, "reward/max": 1.0}})
    xs, low, high = band_of(with_std, panel)
    assert xs == [1] and low == pytest.approx([0.4]) and high == pytest.approx([0.6])
    assert band_of(without, panel) == ([1], [0.0], [1.0])


def test_wall_line_adds_what_the_loop_timed_around_the_step():
    from hybridflow.report.plots import wall_seconds

    plain = {"timing_s/step": 2.0, "timing_s/gen": 0.5, "timing_s/update_actor": 1.5}
    validated_and_saved = {**plain, "timing_s/validation": 1.0, "timing_s/save_checkpoint": 0.25,
                           "timing_s/wait_checkpoint": 0.05}  # fmt: skip
    assert wall_seconds(plain) == 2.0  # the stages inside the step are in timing_s/step already
    assert wall_seconds(validated_and_saved) == pytest.approx(3.3)
    assert wall_seconds({"timing_s/step": 1.0, "timing_s/wait_rollout": 0.5}) == 1.5
    assert wall_seconds({"timing_s/validation": 3.0}) is None  # step 0: validation only
