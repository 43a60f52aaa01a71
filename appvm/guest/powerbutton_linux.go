package guest

import (
	"encoding/binary"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"

	"vmhost/appvm/guest/proto"
)

// Linux input event constants (linux/input-event-codes.h).
const (
	evKey    = 0x01
	keyPower = 116
	// inputEventSize is sizeof(struct input_event) on 64-bit kernels: a
	// struct timeval (16 bytes), type and code (u16 each), value (s32).
	inputEventSize = 24
)

// powerButtonName is the input device name the ACPI button driver gives
// both the fixed-hardware button (qemu) and a PNP0C0C device (Cloud
// Hypervisor).
const powerButtonName = "Power Button"

// watchPowerButton turns a press of the VM's power button into a Stop:
// the workload stops with its grace and the guest powers off, the same
// graceful shutdown a classic guest makes of the button.
func (a *agent) watchPowerButton() {
	press := func() {
		a.log.Info("power button pressed: stopping the workload")
		a.requestStop(&proto.Stop{})
	}
	if n := a.sys.watchPowerButton(press); n == 0 {
		a.log.Warn("no power button to watch (the kernel needs the ACPI button driver and evdev, built in or listed in appvm_modules)")
	}
}

// watchPowerButtons starts a reader for every input device under sysfs
// (/sys) named "Power Button", opened from dev (/dev), and returns how
// many it watches.
func watchPowerButtons(sysfs, dev string, press func()) int {
	names, _ := filepath.Glob(filepath.Join(sysfs, "class/input/event*/device/name"))
	n := 0
	for _, name := range names {
		b, err := os.ReadFile(name)
		if err != nil || strings.TrimSpace(string(b)) != powerButtonName {
			continue
		}
		event := filepath.Base(filepath.Dir(filepath.Dir(name)))
		f, err := os.Open(filepath.Join(dev, "input", event))
		if err != nil {
			continue
		}
		n++
		go readPowerButton(f, press)
	}
	return n
}

// readPowerButton calls press for every key-down of KEY_POWER read from f.
func readPowerButton(f io.ReadCloser, press func()) {
	defer f.Close()
	var ev [inputEventSize]byte
	for {
		if _, err := io.ReadFull(f, ev[:]); err != nil {
			return
		}
		typ := binary.NativeEndian.Uint16(ev[16:])
		code := binary.NativeEndian.Uint16(ev[18:])
		value := int32(binary.NativeEndian.Uint32(ev[20:]))
		if typ == evKey && code == keyPower && value == 1 {
			press()
		}
	}
}

// watchSIGPWR is process mode's power button: the simulator signals the
// agent with SIGPWR where a VM would get an ACPI button press.
func watchSIGPWR(press func()) int {
	c := make(chan os.Signal, 1)
	signal.Notify(c, syscall.SIGPWR)
	go func() {
		for range c {
			press()
		}
	}()
	return 1
}
