package main

import "vmhost/chclient/chsim"

// sim-ch runs the Cloud Hypervisor simulator with cloud-hypervisor's own
// flags (DESIGN §6), so tests and `serve --dev` can use vmhost itself as
// the hypervisor binary.
func init() { extraCommands["sim-ch"] = chsim.Main }
