"""--jobs: the layerwise sweep on worker processes gives the serial numbers to the bit, refuses bad counts in one
line, names the node when a worker fails, and works through the CLI."""
import json

import pytest

import oq
from oq.analysis import measure, parallel
from oq.cli import main


@pytest.mark.parametrize("name", ["resnet_mini", "transformer"])
def test_two_workers_give_the_serial_numbers(name, model_paths, calib_files):
    path, held_out = calib_files[name]
    kw = dict(target="tensorrt", calib=path, eval=held_out, progress=False, batch_size=8)
    serial = oq.analyze(model_paths[name], jobs=1, **kw)
    two = oq.analyze(model_paths[name], jobs=2, **kw)
    assert len(serial.nodes) > 2
    assert [(n.name, n.layerwise_sqnr_db, n.noise_share) for n in two.nodes] == \
           [(n.name, n.layerwise_sqnr_db, n.noise_share) for n in serial.nodes]


@pytest.mark.parametrize("jobs", [0, -1, 1.5, "two", True])
def test_bad_jobs_is_one_line(jobs, model_paths, calib_files):
    with pytest.raises(oq.OqError, match=r"^--jobs \(jobs\): must be an integer >= 1") as err:
        oq.analyze(model_paths["resnet_mini"], calib=calib_files["resnet_mini"][0], jobs=jobs, progress=False)
    assert "\n" not in str(err.value)
    with pytest.raises(oq.OqError, match=r"^--jobs \(jobs\)"):
        oq.quantize_to_goal(model_paths["resnet_mini"], 30.0, calib=calib_files["resnet_mini"][0], jobs=jobs)


def test_automatic_jobs_start_workers_only_for_long_sweeps(model_paths, calib_files, monkeypatch):
    """jobs None: the first node runs here; workers (one per usable CPU) only when the rest would take long here."""
    assert parallel.check_jobs(None) is None and parallel.check_jobs("3") == 3 and parallel.usable_cpus() >= 1
    path, held_out = calib_files["resnet_mini"]
    kw = dict(calib=path, eval=held_out, progress=False)
    serial = [(n.name, n.layerwise_sqnr_db) for n in oq.analyze(model_paths["resnet_mini"], jobs=1, **kw).nodes]
    started = []
    real = parallel.sweep

    def counted(*args):
        started.append(args[-2])  # jobs
        return real(*args)

    monkeypatch.setattr(parallel, "sweep", counted)
    monkeypatch.setattr(parallel, "usable_cpus", lambda: 2)
    assert [(n.name, n.layerwise_sqnr_db) for n in oq.analyze(model_paths["resnet_mini"], **kw).nodes] == serial
    assert started == []  # a sweep of a second or so: no workers
    monkeypatch.setattr(measure, "AUTO_PARALLEL_S", 0.0)
    assert [(n.name, n.layerwise_sqnr_db) for n in oq.analyze(model_paths["resnet_mini"], **kw).nodes] == serial
    assert started == [2]


def test_worker_error_names_the_node(model_paths, calib_files, monkeypatch):
    """A node whose variant cannot be built: the error comes back from the worker as one line naming it."""
    path, held_out = calib_files["resnet_mini"]
    a = oq.analyze(model_paths["resnet_mini"], calib=path, eval=held_out, jobs=1, layerwise=False, progress=False)
    victim = a.nodes[-1].name
    real = parallel.sweep

    def broken(twin, quantized, quantizers, nodes, *rest):
        # the node's name made unknown to the workers' graph: building its variant fails there
        return real(twin, quantized, quantizers, [n if n != victim else victim + "_gone" for n in nodes], *rest)

    monkeypatch.setattr(parallel, "sweep", broken)
    with pytest.raises(oq.OqError, match=rf"^layerwise run of node {victim}_gone: StopIteration") as err:
        oq.analyze(model_paths["resnet_mini"], calib=path, eval=held_out, jobs=2, progress=False)
    assert "\n" not in str(err.value)


def test_cli_jobs(model_paths, calib_files, tmp_path, capsys):
    path, _ = calib_files["resnet_mini"]
    out = tmp_path / "a.json"
    assert main(["analyze", str(model_paths["resnet_mini"]), "--calib", str(path), "--jobs", "2", "-q",
                 "--json", str(out)]) == 0
    serial = oq.analyze(model_paths["resnet_mini"], calib=path, jobs=1, progress=False)
    got = json.loads(out.read_text())["nodes"]
    assert [n["layerwise_sqnr_db"] for n in got] == [n["layerwise_sqnr_db"] for n in serial.to_dict()["nodes"]]
    capsys.readouterr()
    assert main(["analyze", str(model_paths["resnet_mini"]), "--calib", str(path), "--jobs", "0", "-q"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("oq: error: --jobs: must be an integer >= 1") and err.count("\n") == 1
    assert main(["run", str(model_paths["resnet_mini"]), "--calib", str(path), "--jobs", "2", "-q",
                 "-o", str(tmp_path / "q.onnx")]) == 2
    assert capsys.readouterr().err.strip() == "oq: error: --jobs goes with --min-sqnr"
    assert main(["run", str(model_paths["resnet_mini"]), "--calib", str(path), "--min-sqnr", "20", "--jobs", "2",
                 "-q", "-o", str(tmp_path / "goal.onnx")]) == 0
    assert "goal 20.00 dB met" in capsys.readouterr().out
