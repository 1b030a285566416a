"""The GPU suite's choices that do not need a GPU: its thread counts and which parts need one."""
import pytest

from bench.gpu_suite import main, thread_counts
from gpu_ref import gpu_available


@pytest.mark.parametrize("cores, counts", [(1, [1]), (2, [1, 2]), (3, [1, 2, 3]), (8, [1, 2, 4, 8]),
                                           (12, [1, 2, 4, 8, 12]), (16, [1, 2, 4, 8, 16])])
def test_thread_counts_double_up_to_every_core(cores, counts):
    assert thread_counts(cores) == counts


@pytest.mark.skipif(gpu_available(), reason="a GPU is here: the parts would run")
def test_gpu_parts_without_a_gpu_are_refused_by_name(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--parts", "cores,tta", "--out", str(tmp_path)])
    assert "limits, tests, batches, tta need cupy" in capsys.readouterr().err
    assert not (tmp_path / "summary.json").exists()
