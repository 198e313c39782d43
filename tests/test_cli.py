import subprocess
import sys
import time

from hybridflow.cli import main


def test_validate_exit_codes(capsys):
    assert main(["config", "validate"]) == 0
    rc = main(
        [
            "config",
            "validate",
            "data.train_batch_size=60",
            "rollout.n=12",
            "trainer.n_gpus_per_node=64",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2
    assert "data.train_batch_size" in err and "Traceback" not in err


def test_show_marks_derived(capsys):
    assert main(["config", "show", "rollout.n=4"]) == 0
    out = capsys.readouterr().out
    assert "n: 4" in out
    assert "samples_per_step" in out and "# derived" in out


def test_import_is_light():
    code = (
        "import time, sys; t=time.time(); import hybridflow, hybridflow.config, hybridflow.cli; "
        "print(time.time()-t); print('torch' in sys.modules)"
    )
    t0 = time.time()
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert float(out[0]) < 1.0 and time.time() - t0 < 10
    assert out[1] == "False", "import hybridflow must not import torch"
