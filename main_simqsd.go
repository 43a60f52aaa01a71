package main

import "vmhost/qmp/qsdsim"

// sim-qsd runs the qemu-storage-daemon simulator with qemu-storage-daemon's
// own options (DESIGN §6), so tests and `serve --dev` can use vmhost itself
// as the storage daemon binary.
func init() { extraCommands["sim-qsd"] = qsdsim.Main }
