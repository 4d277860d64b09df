import errno

import pytest

from rltools.durable import atomic_path, atomic_write


def test_atomic_path_file_appears_only_after_the_block(tmp_path):
    final = tmp_path / "shard.h5"
    with atomic_path(final) as tmp:
        tmp.write_bytes(b"new")
        assert not final.exists()
        assert tmp.parent == tmp_path and tmp.name.startswith(".shard.h5.") and tmp.name.endswith(".tmp")
    assert final.read_bytes() == b"new"
    assert list(tmp_path.iterdir()) == [final]


def test_atomic_path_exception_keeps_old_file_and_leaves_no_temporary(tmp_path):
    final = tmp_path / "address.json"
    final.write_text("old")
    with pytest.raises(RuntimeError, match="writer failed"):
        with atomic_path(final) as tmp:
            tmp.write_text("half")
            raise RuntimeError("writer failed")
    assert final.read_text() == "old"
    assert list(tmp_path.iterdir()) == [final]


def test_atomic_path_names_the_final_file_in_an_oserror(tmp_path):
    final = tmp_path / "config.yaml"
    with pytest.raises(OSError) as err:
        with atomic_path(final) as tmp:
            tmp.write_text("half")
            raise OSError(errno.ENOSPC, "No space left on device")
    assert err.value.errno == errno.ENOSPC and err.value.filename == str(final)
    assert list(tmp_path.iterdir()) == []


def test_atomic_write_replaces_the_file(tmp_path):
    final = tmp_path / "eval.json"
    atomic_write(final, "old")
    atomic_write(final, b"new")
    assert final.read_bytes() == b"new"
    assert list(tmp_path.iterdir()) == [final]


def test_publish_dir_puts_the_complete_directory_in_place_of_a_leftover(tmp_path):
    from rltools.durable import publish_dir

    tmp, final = tmp_path / ".step_3.tmp", tmp_path / "step_3"
    tmp.mkdir()
    (tmp / "marker").write_text("done")
    final.mkdir()
    (final / "half-written").write_text("")  # an interrupted earlier attempt under the final name
    publish_dir(tmp, final)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_3"]
    assert sorted(p.name for p in final.iterdir()) == ["marker"]
