"""Run-dir I/O: the names of every file a run dir holds (``layout``) and what each holds
(``catalogue``), atomic writes (``atomic``), write-error classes (``writes``), bounded
reads of hostile files (``safe_read``) and the damage a reader reports (``damage``)."""
