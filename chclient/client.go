package chclient

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"time"

	"vmhost/internal/nofollow"
)

// ErrNotFound is matched (errors.Is) by an *APIError with status 404: CH answers 404 when no
// VM has been created, or an action needs a VM config that is missing.
var ErrNotFound = errors.New("cloud hypervisor: not found")

// maxResponseBody bounds what the client reads from one response; CH's largest answer,
// vm.info, is a few kilobytes.
const maxResponseBody = 4 << 20

// APIError is a CH answer with an unexpected status. Body holds CH's error chain, outermost
// first (["Error from API", "The VM could not boot", …]); a body that is not a JSON array of
// strings is kept as its one element.
type APIError struct {
	Method string
	Path   string // the path under /api/v1/, e.g. "vm.boot"
	Status int
	Body   []string
}

// Error formats the request, the status and the error chain joined by ": ".
func (e *APIError) Error() string {
	msg := fmt.Sprintf("cloud hypervisor %s %s: status %d", e.Method, e.Path, e.Status)
	if len(e.Body) > 0 {
		msg += ": " + strings.Join(e.Body, ": ")
	}
	return msg
}

// Is reports whether target is ErrNotFound and the status is 404.
func (e *APIError) Is(target error) bool {
	return target == ErrNotFound && e.Status == http.StatusNotFound
}

// Last returns the innermost message of the error chain, or "" if there is none.
func (e *APIError) Last() string {
	if len(e.Body) == 0 {
		return ""
	}
	return e.Body[len(e.Body)-1]
}

// Client talks to one CH process. It is safe for concurrent use; CH serves at most 10
// connections at a time, so callers should not fan out wider than that.
type Client struct {
	// Dial, when set before the first call, replaces dialing the unix socket. It exists
	// for tests that put CH behind something other than a socket path.
	Dial func(ctx context.Context) (net.Conn, error)

	socket string
	hc     *http.Client
}

// New returns a client for the CH API socket at socketPath. Nothing is dialed until the
// first call. Close releases idle connections.
func New(socketPath string) *Client {
	c := &Client{socket: socketPath}
	tr := &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			if c.Dial != nil {
				return c.Dial(ctx)
			}
			return nofollow.DialUnix(ctx, c.socket)
		},
		DisableCompression:  true,
		MaxIdleConnsPerHost: 2,
		// Calls come in bursts (vm.create, vm.info, vm.boot, vm.info), then
		// nothing for hours: an idle connection is dropped soon, so an idle
		// VM costs the agent no connection (two goroutines and 8 KiB of
		// buffers in net/http).
		IdleConnTimeout: 2 * time.Second,
	}
	c.hc = &http.Client{Transport: tr}
	return c
}

// SocketPath returns the API socket path the client was built for.
func (c *Client) SocketPath() string { return c.socket }

// Close drops idle keep-alive connections. The client stays usable.
func (c *Client) Close() {
	c.hc.CloseIdleConnections()
}

// send performs one request. body, if non-nil, is encoded as JSON with an exact
// Content-Length. The answer must have one of the wanted statuses; its body is returned.
func (c *Client) send(ctx context.Context, method, path string, body any, want ...int) (int, []byte, error) {
	var rd io.Reader
	if body != nil {
		payload, err := json.Marshal(body)
		if err != nil {
			return 0, nil, fmt.Errorf("encoding %s body: %w", path, err)
		}
		rd = bytes.NewReader(payload)
	}
	req, err := http.NewRequestWithContext(ctx, method, "http://localhost/api/v1/"+path, rd)
	if err != nil {
		return 0, nil, fmt.Errorf("cloud hypervisor %s %s: %w", method, path, err)
	}
	// NewRequest takes ContentLength from the bytes.Reader, so no body is chunked (CH
	// does not support chunked bodies); a PUT without a body goes out with
	// "Content-Length: 0", which CH treats as no body.
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	req.Header.Set("Accept", "application/json")
	resp, err := c.hc.Do(req)
	if err != nil {
		return 0, nil, fmt.Errorf("cloud hypervisor %s %s: %w", method, path, err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, maxResponseBody))
	if err != nil {
		return resp.StatusCode, nil, fmt.Errorf("cloud hypervisor %s %s: reading response: %w", method, path, err)
	}
	for _, w := range want {
		if resp.StatusCode == w {
			return resp.StatusCode, data, nil
		}
	}
	return resp.StatusCode, data, &APIError{Method: method, Path: path, Status: resp.StatusCode, Body: errorChain(data)}
}

// errorChain decodes CH's error body: a JSON array of strings (v47+), micro_http's
// {"error": "…"} for requests it could not parse, or plain text from older versions.
func errorChain(data []byte) []string {
	data = bytes.TrimSpace(data)
	if len(data) == 0 {
		return nil
	}
	var chain []string
	if json.Unmarshal(data, &chain) == nil {
		return chain
	}
	var obj struct {
		Error string `json:"error"`
	}
	if json.Unmarshal(data, &obj) == nil && obj.Error != "" {
		return []string{obj.Error}
	}
	return []string{string(data)}
}

func (c *Client) decode(ctx context.Context, method, path string, body any, out any, want ...int) error {
	_, data, err := c.send(ctx, method, path, body, want...)
	if err != nil {
		return err
	}
	if err := json.Unmarshal(data, out); err != nil {
		return fmt.Errorf("cloud hypervisor %s %s: decoding response: %w", method, path, err)
	}
	return nil
}

// Ping calls vmm.ping.
func (c *Client) Ping(ctx context.Context) (*VmmPingResponse, error) {
	var r VmmPingResponse
	if err := c.decode(ctx, http.MethodGet, "vmm.ping", nil, &r, http.StatusOK); err != nil {
		return nil, err
	}
	return &r, nil
}

// CreateVM stores cfg as the VM config (vm.create). CH validates it only at BootVM.
func (c *Client) CreateVM(ctx context.Context, cfg *VmConfig) error {
	if cfg == nil {
		return errors.New("cloud hypervisor vm.create: nil config")
	}
	_, _, err := c.send(ctx, http.MethodPut, "vm.create", cfg, http.StatusNoContent)
	return err
}

func (c *Client) action(ctx context.Context, path string) error {
	_, _, err := c.send(ctx, http.MethodPut, path, nil, http.StatusNoContent)
	return err
}

// BootVM boots the created VM (vm.boot); it returns once the VM runs.
func (c *Client) BootVM(ctx context.Context) error { return c.action(ctx, "vm.boot") }

// ShutdownVM stops the VM (vm.shutdown); the config stays and the state reads Created.
func (c *Client) ShutdownVM(ctx context.Context) error { return c.action(ctx, "vm.shutdown") }

// PowerButton presses the ACPI power button (vm.power-button); the guest decides.
func (c *Client) PowerButton(ctx context.Context) error { return c.action(ctx, "vm.power-button") }

// RebootVM reboots the VM in the same process (vm.reboot).
func (c *Client) RebootVM(ctx context.Context) error { return c.action(ctx, "vm.reboot") }

// PauseVM pauses the vCPUs (vm.pause).
func (c *Client) PauseVM(ctx context.Context) error { return c.action(ctx, "vm.pause") }

// ResumeVM resumes a paused VM (vm.resume).
func (c *Client) ResumeVM(ctx context.Context) error { return c.action(ctx, "vm.resume") }

// DeleteVM drops the VM and its config (vm.delete), stopping it first; it succeeds in every
// state.
func (c *Client) DeleteVM(ctx context.Context) error { return c.action(ctx, "vm.delete") }

// ShutdownVMM asks the process to exit (vmm.shutdown). CH answers 200 although its OpenAPI
// says 204; both are accepted.
func (c *Client) ShutdownVMM(ctx context.Context) error {
	_, _, err := c.send(ctx, http.MethodPut, "vmm.shutdown", nil, http.StatusOK, http.StatusNoContent)
	return err
}

// VMInfo returns vm.info. Before vm.create it fails with an error matching ErrNotFound.
func (c *Client) VMInfo(ctx context.Context) (*VmInfo, error) {
	var r VmInfo
	if err := c.decode(ctx, http.MethodGet, "vm.info", nil, &r, http.StatusOK); err != nil {
		return nil, err
	}
	return &r, nil
}

// AddDisk adds a disk (vm.add-disk). On a running VM CH answers with the new device's id
// and PCI address; on a VM that is only created the disk is added to the config and the
// returned info is nil.
func (c *Client) AddDisk(ctx context.Context, disk *DiskConfig) (*PciDeviceInfo, error) {
	if disk == nil {
		return nil, errors.New("cloud hypervisor vm.add-disk: nil disk")
	}
	status, data, err := c.send(ctx, http.MethodPut, "vm.add-disk", disk, http.StatusOK, http.StatusNoContent)
	if err != nil || status == http.StatusNoContent {
		return nil, err
	}
	var info PciDeviceInfo
	if err := json.Unmarshal(data, &info); err != nil {
		return nil, fmt.Errorf("cloud hypervisor PUT vm.add-disk: decoding response: %w", err)
	}
	return &info, nil
}

// RemoveDevice requests the hot-unplug of the device with this id (vm.remove-device). CH
// answers once the unplug is requested; a "vm device-removed" event follows when the guest
// ejects it.
func (c *Client) RemoveDevice(ctx context.Context, id string) error {
	_, _, err := c.send(ctx, http.MethodPut, "vm.remove-device", &VmRemoveDevice{ID: id}, http.StatusNoContent)
	return err
}

// Resize changes vCPUs, RAM or balloon (vm.resize). On a created VM it edits the config.
func (c *Client) Resize(ctx context.Context, r *VmResize) error {
	if r == nil {
		return errors.New("cloud hypervisor vm.resize: nil request")
	}
	_, _, err := c.send(ctx, http.MethodPut, "vm.resize", r, http.StatusNoContent)
	return err
}

// Counters returns vm.counters: device id → counter name → value.
func (c *Client) Counters(ctx context.Context) (map[string]map[string]uint64, error) {
	var r map[string]map[string]uint64
	if err := c.decode(ctx, http.MethodGet, "vm.counters", nil, &r, http.StatusOK); err != nil {
		return nil, err
	}
	return r, nil
}
