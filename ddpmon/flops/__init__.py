"""FLOPs and MFU: FLOPs per step counted by ``FlopCounterMode`` on one step (:mod:`.count`) or
given, peak FLOP/s from a table of devices (:mod:`.peaks`) or given, and the rates a rank serves
(:mod:`.mfu`). docs/goodput.md, MFU."""
