package chsim

import (
	"encoding/json"
	"errors"
	"net/http"
	"os"
	"slices"
	"strings"
	"syscall"
)

// The /sim/v1/ namespace on the API socket drives what a guest would do. Every action is
// PUT and answers 204, 400 for a bad body, 404 for an unknown path, or 409 with
// {"error": "…"} when the VM's state does not allow it:
//
//	PUT /sim/v1/activate          the guest's drivers take every device they have a driver
//	                              for (the watchdog's they lack): virtio-device activated for
//	                              each CH implements itself (none for vhost-user disks and
//	                              nets). {"devices":[id,…]}: only those (a kernel without the
//	                              others' drivers, or one loading them later); 409 when none
//	                              is taken, or for an id that is not a device the guest takes
//	PUT /sim/v1/poweroff          ACPI poweroff from the guest (exit 0 unless --no-shutdown)
//	PUT /sim/v1/reboot            the guest resets itself (vm rebooting/rebooted, same pid)
//	PUT /sim/v1/panic             {"event":"panic"|"crash_loaded"}: pvpanic write
//	PUT /sim/v1/hang              the VMM stops answering /api/v1/
//	PUT /sim/v1/crash             {"signal":N}: the process dies by signal N
//	PUT /sim/v1/serial            {"data":"…"}: the guest prints on its serial port
//	PUT /sim/v1/vsock/listen      {"port":N}: a guest program listens on vsock port N
//	PUT /sim/v1/vsock/unlisten    {"port":N}
//	PUT /sim/v1/vsock/connect     {"port":N,"data":"…"}: the guest dials host port N
//	PUT /sim/v1/dhcp-ack          {"ip","server","mask"?,"router"?,"lease"?,"net"?,"server_mac"?}:
//	                              a DHCP ACK for the guest's MAC leaves the tap toward the guest
//	PUT /sim/v1/guest-agent       {"signal":N}: signal the AppVM guest agent process (not its
//	                              workload); SIGSTOP silences its heartbeats
//	PUT /sim/v1/counters          {"device":"_disk0","counters":{"read_bytes":N,…}}: the guest's
//	                              I/O moved the device's vm.counters to these values
//	PUT /sim/v1/eject             {"refuse":true|false}: while refusing, the guest ignores
//	                              eject requests: vm.remove-device on a booted VM answers 204
//	                              but nothing is removed and no vm device-removed follows (a
//	                              request made meanwhile is lost; a later one is honoured)
//	PUT /sim/v1/open              {"path","write"?}: the process opens path (read-only, or
//	                              read-write): 204 when it could, 409 {"error","errno"} when
//	                              not (what a VMM taken over by its guest could reach)
//	PUT /sim/v1/hog               {"mb":N}: the process allocates and touches N MiB and keeps
//	                              them (a runaway VMM): 204 once touched, unless a memory
//	                              limit kills it first
//	PUT /sim/v1/power-button      {"ignore":true|false}: while ignoring, a classic guest that
//	                              is up does nothing on the ACPI power button (vm.power-button
//	                              answers 204); otherwise it powers off 50 ms after the press,
//	                              as systemd would. An AppVM's guest agent takes the button
//	                              either way.
//	GET /sim/v1/status            {"state","activated","hung","taps","vhost_conns","guest_ports",
//	                              "guest_agent_pid","refuse_eject","ignore_power_button"}
func (s *sim) control(r *request) (response, func()) {
	name := strings.TrimPrefix(r.path, "/sim/v1/")
	if name == "status" {
		if r.method != http.MethodGet {
			return controlError(http.StatusMethodNotAllowed, "use GET"), nil
		}
		return s.status(), nil
	}
	if r.method != http.MethodPut {
		return controlError(http.StatusMethodNotAllowed, "use PUT"), nil
	}
	var body struct {
		Event  string  `json:"event"`
		Signal int     `json:"signal"`
		Data   string  `json:"data"`
		Port   *uint32 `json:"port"`
		Refuse *bool   `json:"refuse"`
		Path   string  `json:"path"`
		Write  bool    `json:"write"`
		MB     int     `json:"mb"`
		Ignore *bool   `json:"ignore"`
		// Devices (activate): the ids of the devices the guest's drivers take.
		Devices []string `json:"devices"`
	}
	if r.body != nil {
		if err := json.Unmarshal(r.body, &body); err != nil {
			return controlError(http.StatusBadRequest, "decoding body: "+err.Error()), nil
		}
	}
	needPort := func() (uint32, *response) {
		if body.Port == nil {
			resp := controlError(http.StatusBadRequest, "port is required")
			return 0, &resp
		}
		return *body.Port, nil
	}
	switch name {
	case "activate":
		s.mu.Lock()
		for _, id := range body.Devices {
			if !slices.Contains(s.order, id) || !guestDriverTakes(id) {
				s.mu.Unlock()
				return controlError(http.StatusConflict, "no device "+id+" the guest's drivers take"), nil
			}
		}
		ok := s.activateLocked(body.Devices...)
		s.mu.Unlock()
		if !ok {
			return controlError(http.StatusConflict, "the VM is not running or its devices are already active"), nil
		}
		return noContent(), nil
	case "poweroff":
		s.mu.Lock()
		running := s.state == stateRunning
		s.mu.Unlock()
		if !running {
			return controlError(http.StatusConflict, "the VM is not running"), nil
		}
		if s.cfg.NoShutdown {
			s.guestPoweroff(0)
			return noContent(), nil
		}
		// The process exits: answer first.
		return noContent(), func() { s.guestPoweroff(0) }
	case "reboot":
		s.mu.Lock()
		defer s.mu.Unlock()
		if s.state != stateRunning {
			return controlError(http.StatusConflict, "the VM is not running"), nil
		}
		s.resetDevicesLocked()
		if chain := s.rebootLocked(); chain != nil {
			return controlError(http.StatusInternalServerError, strings.Join(chain, ": ")), nil
		}
		return noContent(), nil
	case "panic":
		ev := body.Event
		if ev == "" {
			ev = "panic"
		}
		if ev != "panic" && ev != "crash_loaded" {
			ev = "unknown_event"
		}
		s.mu.Lock()
		defer s.mu.Unlock()
		if s.state != stateRunning {
			return controlError(http.StatusConflict, "the VM is not running"), nil
		}
		if !s.vm.Pvpanic {
			return controlError(http.StatusConflict, "the VM has no pvpanic device"), nil
		}
		s.serialWrite("Kernel panic - not syncing: chsim\r\n")
		s.emit("guest", "panic", map[string]string{"event": ev})
		return noContent(), nil
	case "hang":
		// /sim/v1/ keeps answering, so this response still goes out.
		s.hung.Store(true)
		return noContent(), nil
	case "crash":
		sig := syscall.Signal(body.Signal)
		if body.Signal <= 0 || body.Signal >= 65 {
			return controlError(http.StatusBadRequest, "signal must be 1…64"), nil
		}
		return noContent(), func() { die(sig) }
	case "serial":
		s.mu.Lock()
		s.serialWrite(body.Data)
		s.mu.Unlock()
		return noContent(), nil
	case "dhcp-ack":
		var req dhcpAckRequest
		if err := json.Unmarshal(r.body, &req); err != nil {
			return controlError(http.StatusBadRequest, "decoding body: "+err.Error()), nil
		}
		if err := s.dhcpAck(req); err != nil {
			return controlError(http.StatusConflict, err.Error()), nil
		}
		return noContent(), nil
	case "counters":
		var req struct {
			Device   string            `json:"device"`
			Counters map[string]uint64 `json:"counters"`
		}
		if err := json.Unmarshal(r.body, &req); err != nil {
			return controlError(http.StatusBadRequest, "decoding body: "+err.Error()), nil
		}
		s.mu.Lock()
		defer s.mu.Unlock()
		dev, ok := s.counters[req.Device]
		if !ok {
			return controlError(http.StatusConflict, "no device "+req.Device+" has counters"), nil
		}
		for k, v := range req.Counters {
			if _, ok := dev[k]; !ok {
				return controlError(http.StatusBadRequest, "device "+req.Device+" has no counter "+k), nil
			}
			dev[k] = v
		}
		return noContent(), nil
	case "eject":
		if body.Refuse == nil {
			return controlError(http.StatusBadRequest, "refuse is required"), nil
		}
		s.mu.Lock()
		s.refuseEject = *body.Refuse
		s.mu.Unlock()
		return noContent(), nil
	case "power-button":
		if body.Ignore == nil {
			return controlError(http.StatusBadRequest, "ignore is required"), nil
		}
		s.mu.Lock()
		s.ignorePowerButton = *body.Ignore
		s.mu.Unlock()
		return noContent(), nil
	case "guest-agent":
		if body.Signal <= 0 || body.Signal >= 65 {
			return controlError(http.StatusBadRequest, "signal must be 1…64"), nil
		}
		if err := s.signalAgentOnly(syscall.Signal(body.Signal)); err != nil {
			return controlError(http.StatusConflict, err.Error()), nil
		}
		return noContent(), nil
	case "open":
		if body.Path == "" {
			return controlError(http.StatusBadRequest, "path is required"), nil
		}
		flag := os.O_RDONLY
		if body.Write {
			flag = os.O_RDWR
		}
		f, err := os.OpenFile(body.Path, flag, 0)
		if err != nil {
			var errno syscall.Errno
			errors.As(err, &errno)
			return jsonResponse(http.StatusConflict, map[string]any{"error": err.Error(), "errno": int(errno)}), nil
		}
		f.Close()
		return noContent(), nil
	case "hog":
		if body.MB <= 0 {
			return controlError(http.StatusBadRequest, "mb must be positive"), nil
		}
		b := make([]byte, body.MB<<20)
		for i := 0; i < len(b); i += 4096 {
			b[i] = 1
		}
		s.mu.Lock()
		s.hogged = append(s.hogged, b)
		s.mu.Unlock()
		return noContent(), nil
	case "vsock/listen", "vsock/unlisten":
		port, bad := needPort()
		if bad != nil {
			return *bad, nil
		}
		s.mu.Lock()
		if name == "vsock/listen" {
			s.guestPorts[port] = true
		} else {
			delete(s.guestPorts, port)
		}
		s.mu.Unlock()
		return noContent(), nil
	case "vsock/connect":
		port, bad := needPort()
		if bad != nil {
			return *bad, nil
		}
		if err := s.guestConnect(port, []byte(body.Data)); err != nil {
			return controlError(http.StatusConflict, err.Error()), nil
		}
		return noContent(), nil
	}
	return controlError(http.StatusNotFound, "unknown simulator action "+name), nil
}

func controlError(status int, msg string) response {
	return jsonResponse(status, map[string]string{"error": msg})
}

func (s *sim) status() response {
	s.mu.Lock()
	defer s.mu.Unlock()
	var taps []string
	for _, f := range s.taps {
		taps = append(taps, strings.TrimPrefix(f.Name(), "tap:"))
	}
	var ports []uint32
	for p := range s.guestPorts {
		ports = append(ports, p)
	}
	return jsonResponse(http.StatusOK, map[string]any{
		"state":               s.state.String(),
		"activated":           s.activated,
		"hung":                s.hung.Load(),
		"taps":                taps,
		"vhost_conns":         len(s.vhost),
		"guest_ports":         ports,
		"guest_agent_pid":     s.agentPidLocked(),
		"refuse_eject":        s.refuseEject,
		"ignore_power_button": s.ignorePowerButton,
	})
}
