"""pyarrow is a core dependency, but ``attach`` and the training thread never import it: the
history thread does (about 50 ms once, off the training loop)."""

from __future__ import annotations


def test_pyarrow_is_imported_by_the_history_thread_only(tmp_path, procs):
    done = procs.run(
        """
        import sys, threading, traceback
        importers = []

        class Watch:
            def find_spec(self, name, path=None, target=None):
                stack = traceback.extract_stack()
                lookup = any(f.filename.endswith("importlib.util>") for f in stack)
                if name == "pyarrow" and not lookup:  # an import, not a find_spec look-up
                    importers.append(threading.current_thread().name)
                return None

        sys.meta_path.insert(0, Watch())
        import torch
        import ddpmon

        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        mon = ddpmon.attach(model, opt, port=0, run_dir=sys.argv[1], run_id="imp")
        for _ in range(3):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
        mon.close()
        print(importers)
        """,
        str(tmp_path),
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['ddpmon-history']", done.stdout + done.stderr
    assert (tmp_path / "imp" / "history.rank0.arrow").exists()
