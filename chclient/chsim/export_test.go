package chsim

import "encoding/json"

// QemuCommandLine is the qemu command line the backend runs for a VM config (a vm.create
// body), with qemu's monitor on fd 3 and its serial port on fd 4: the same guest, for
// benchmarks that run qemu without the simulator.
func QemuCommandLine(config []byte, accel string) ([]string, error) {
	var cfg vmConfig
	if err := json.Unmarshal(config, &cfg); err != nil {
		return nil, err
	}
	if err := validate(&cfg); err != nil {
		return nil, err
	}
	s := &sim{vm: &cfg}
	s.assignDevicesLocked()
	args, _, err := qemuArgs(&cfg, s.bdfs, qemuLaunch{Accel: accel, QMPFD: 3, SerialFD: 4})
	return args, err
}
