// Package proto is the wire protocol between vmhost (the host side of an
// AppVM) and its guest agent (`vmhost guest`, PID 1 inside the VM).
//
// # Transport
//
// The guest dials the host: AF_VSOCK CID 2 (the host), port [Port]. With
// Cloud Hypervisor's hybrid vsock the host side is a unix listener at
// `<vsock socket>_<Port>`. There is one session connection per boot (a
// redial after a host agent restart replaces it); from version 3 on the
// host also dials the guest for each operation (below).
//
// # Framing
//
// Every message is one frame: a 4-byte big-endian length, then that many bytes
// of JSON, an envelope {"type": "...", "body": {...}}. A frame larger than
// [MaxFrame] is refused before it is read, so a broken or hostile peer cannot
// make the other side allocate without bound (newline-delimited JSON would
// need a line cap anyway, and a workload's log chunk may hold newlines).
//
// # Versions and order
//
// The guest speaks first with [Hello]; the host answers with [Spec]. Both
// carry V = [Version]. Decoding is strict: an unknown message type, an unknown
// field, trailing data or a missing body is an error. Any change to a message
// therefore bumps Version, and a host that sees an older Hello sends what that
// version understands (the Spec with the guest's V). After the Spec the guest
// sends [Heartbeat], [Lease], [Started], [Health], [Log], [Exit] and [Fatal] as
// things happen; the host may send [Stop], and from version 2 on [Mount] and
// [Unmount], each answered by one [MountResult] with the same Seq,
// [ExitAck] once it has recorded an Exit or a Fatal, and from version 3 on
// [LogAck]. When the connection breaks (a host agent restart), the guest
// redials and sends a Hello with Resume set instead of expecting a Spec.
//
// Version history: 1, the first; 2 adds Mount, Unmount and MountResult (a
// volume hot-plugged into or out of a running AppVM) and ExitAck: a
// version 2 guest without Keepalive powers off after the workload's end
// only once the host acknowledged it (or sent Stop), so an end that
// happens while the host agent is down reaches the next one, replayed on
// resume, and its restart policy applies. 3 adds operation connections
// (below: a version 3 guest listens on [OpPort]), Log.At, and LogAck with
// the replay of unacknowledged logs on resume: a version 3 guest keeps the
// Log messages the host has not acknowledged (up to [MaxLogBacklog] bytes
// of output, the oldest dropped first) and, when it resumes with a host
// whose Spec said version 3, sends them again, with their Seq and At,
// after the Lease and Started and before the Exit, Fatal and Health; the
// host drops those it already stored (by Seq within the BootID), and a gap
// in Seq is output lost while the host was away. A guest never sends At to
// a host whose Spec said an older version (its decoding is strict). 4 adds
// Hello.LogSeq: a guest restored from a snapshot with memory resumes with
// the numbering it had at the snapshot, behind what the host stored of the
// timeline the restore discarded; without it the host would take the
// restored guest's new output for replays and drop it.
//
// # Host side
//
// Listen on `<vsock socket>_<Port>` before booting; accept; Recv the Hello.
// Without Resume, Send the Spec; with Resume (same BootID as before), send
// nothing and take the replayed state; a LogSeq behind the Log Seq stored
// of that boot is a guest gone back to a snapshot: its Log messages above
// LogSeq are new output, whatever was stored under their numbers. Then Recv until EOF: the first
// Heartbeat is the guest's sign of life; Exit and Fatal describe the
// workload's end; the guest powers off afterwards unless Spec.Keepalive.
// Send Stop for a graceful shutdown (the guest takes the ACPI power button
// for one too). Send ExitAck after recording an Exit or Fatal. Send Mount
// after hot-plugging a volume
// and Unmount before unplugging one, and wait for the MountResult; a guest
// whose Hello says V 1 knows neither. To a guest of version 3, send LogAck
// once Log messages are stored, so that it forgets them; never to an older
// one, whose strict decoding would fail the session.
//
// # Operation connections (version 3)
//
// Exec, file transfers and signals each use a connection of their own,
// dialled by the host to the guest's vsock port [OpPort] (through Cloud
// Hypervisor's hybrid vsock: `CONNECT 1025\n` on the vsock socket, answered
// `OK <hostport>\n`), so that each is its own byte stream with the
// transport's flow control as back-pressure, and the session above is
// untouched. A guest whose Hello says a version below 3 does not listen:
// the host refuses these operations ("restart the AppVM to get the new
// guest agent").
//
// On such a connection every frame is 1 byte of [FrameType], 3 zero bytes,
// the payload's length as 4 bytes big-endian, then the payload (at most
// [MaxPayload] bytes) — the layout of the API's interactive exec frames,
// whose types 0 to 5 mean the same here. The host's first frame is
// FrameRequest, JSON [Request] with exactly one operation:
//
//   - exec: the guest answers FrameStarted (JSON [ExecStarted]) or
//     FrameError; then FrameStdout and FrameStderr carry output as it comes
//     and FrameExit (JSON [ExecExit]) ends it. The host sends FrameStdin,
//     FrameStdinClosed and (with a TTY) FrameResize whenever it likes.
//   - get_files: FrameData frames carry a tar archive, FrameEnd ends it; or
//     FrameError (first, or after some data).
//   - put_files: the host sends the archive as FrameData frames and
//     FrameEnd; the guest answers FrameDone (JSON [PutResult]) once it is
//     extracted, or FrameError (possibly before the host finished sending).
//   - signal: FrameDone (payload {}) once delivered, or FrameError.
//
// FrameError carries a JSON [OpError] and is the last frame. The guest
// closes the connection after the last frame; a host that closes it (or
// vanishes) first abandons the operation: an exec'd process is killed with
// its process group, a partial put leaves nothing. The functions in
// op_client.go ([Exec], [StartExec], [GetFiles], [PutFiles], [Signal]) are
// the host side.
//
// # Secrets
//
// Secret env values and secret file contents travel only in [Spec], as
// [Secret] values: they encode their real value in JSON (the guest needs it),
// and print as "[redacted]" through fmt, slog and errors. They must never be
// put on the kernel command line, in the initramfs or in a log. The guest
// does not redact what the workload or an exec'd process prints (Log data,
// exec output may hold secrets; an exec'd process has the secret
// variables): the host does, before anything reaches an answer or a file.
package proto

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"strings"
	"sync"
	"time"
)

// Version is the protocol version carried by Hello and Spec: the newest
// this package speaks. Versions from [MinVersion] on are accepted.
const Version = 4

// MinVersion is the oldest version either side still accepts.
const MinVersion = 1

// Version2 added Mount, Unmount, MountResult and ExitAck: a peer of an
// older version knows none of them.
const Version2 = 2

// Version3 added operation connections on OpPort, Log.At, LogAck and the
// replay of unacknowledged logs on resume.
const Version3 = 3

// Version4 added Hello.LogSeq.
const Version4 = 4

// Port is the vsock port the guest dials on the host (CID 2).
const Port = 1024

// HostCID is the vsock context id of the host.
const HostCID = 2

// MaxFrame is the largest frame (envelope JSON) either side accepts.
const MaxFrame = 4 << 20

// MaxLogChunk is the largest Log.Data the guest sends in one message.
const MaxLogChunk = 64 << 10

// MaxLogBacklog bounds the output a version 3 guest keeps for replay until
// the host acknowledges it.
const MaxLogBacklog = 4 << 20

// MaxHealthOutput is the largest Health.Output the guest sends.
const MaxHealthOutput = 4096

// ErrFrameTooLarge reports a frame whose length prefix exceeds MaxFrame.
var ErrFrameTooLarge = errors.New("frame exceeds the maximum size")

// Redacted is what a Secret prints as.
const Redacted = "[redacted]"

// Secret is a value that must reach the guest but never a log: it marshals
// its value to JSON, and prints as "[redacted]" through every fmt verb, slog
// and String. The zero value is the empty secret.
type Secret struct{ v string }

// NewSecret wraps v.
func NewSecret(v string) Secret { return Secret{v} }

// Reveal returns the secret value. Call it only where the value is used.
func (s Secret) Reveal() string { return s.v }

// String returns "[redacted]".
func (s Secret) String() string { return Redacted }

// GoString returns "[redacted]", for %#v.
func (s Secret) GoString() string { return Redacted }

// Format prints "[redacted]" for every verb, so %x or %q cannot leak it.
func (s Secret) Format(f fmt.State, _ rune) { io.WriteString(f, Redacted) }

// LogValue keeps the value out of slog output.
func (s Secret) LogValue() slog.Value { return slog.StringValue(Redacted) }

// MarshalJSON encodes the real value: JSON is the wire, and the guest needs it.
func (s Secret) MarshalJSON() ([]byte, error) { return json.Marshal(s.v) }

// UnmarshalJSON decodes a JSON string.
func (s *Secret) UnmarshalJSON(b []byte) error {
	var v string
	if err := json.Unmarshal(b, &v); err != nil {
		return fmt.Errorf("secret: want a string")
	}
	s.v = v
	return nil
}

// Message is one of the message types of this package.
type Message interface {
	// Type is the envelope's type name.
	Type() string
	// Validate checks the field rules beyond types.
	Validate() error
}

// Hello is the guest's first message.
type Hello struct {
	V            int    `json:"v"`
	AgentVersion string `json:"agent_version"`
	// BootID is random per boot of the agent.
	BootID string `json:"boot_id"`
	// Resume reports a reconnection within the same boot (same BootID)
	// after the connection was lost (a host agent restart): the host sends
	// no Spec, and the guest follows with its current state, the last
	// Lease, Started, Exit and Health it sent, in that order. Messages
	// from the outage (logs, heartbeats) are not replayed.
	Resume bool `json:"resume,omitempty"`
	// LogSeq (version 4, with Resume, to a host whose Spec said version
	// 4) is the Seq of the last Log the guest numbered in this boot (0:
	// none yet). It is never behind what the host stored of this boot
	// unless the guest went back in time (a restore of a snapshot with
	// memory): the host then takes the guest's numbering from there on.
	LogSeq *uint64 `json:"log_seq,omitempty"`
}

// Spec is the host's first message: everything the guest needs to set up and
// run the workload.
type Spec struct {
	V int `json:"v"`
	// Entrypoint and Command form the argument vector, Entrypoint first
	// (the image's ENTRYPOINT and CMD). The host resolves image defaults.
	Entrypoint []string `json:"entrypoint,omitempty"`
	Command    []string `json:"command,omitempty"`
	// Env holds KEY=VALUE entries; SecretEnv is applied after it.
	Env       []string    `json:"env,omitempty"`
	SecretEnv []SecretEnv `json:"secret_env,omitempty"`
	// User is "name", "uid", "name:group" or "uid:gid", resolved through the
	// workload root's /etc/passwd and /etc/group. Empty means root.
	User string `json:"user,omitempty"`
	// Workdir is the working directory inside the workload root; empty means /.
	Workdir     string       `json:"workdir,omitempty"`
	Hostname    string       `json:"hostname,omitempty"`
	Network     Network      `json:"network"`
	ExtraHosts  []HostEntry  `json:"extra_hosts,omitempty"`
	ConfigFiles []ConfigFile `json:"config_files,omitempty"`
	SecretFiles []SecretFile `json:"secret_files,omitempty"`
	TmpfsMounts []TmpfsMount `json:"tmpfs_mounts,omitempty"`
	DataMounts  []DataMount  `json:"data_mounts,omitempty"`
	Healthcheck *Healthcheck `json:"healthcheck,omitempty"`
	// Keepalive keeps the guest up after the workload exits; otherwise the
	// guest powers off.
	Keepalive bool `json:"keepalive,omitempty"`
	// StopGraceSecs is the time between SIGTERM and SIGKILL on Stop; 0 means 10.
	StopGraceSecs int `json:"stop_grace_secs,omitempty"`
	// HeartbeatSecs is the heartbeat interval; 0 keeps the guest's default.
	HeartbeatSecs int `json:"heartbeat_secs,omitempty"`
}

// SecretEnv is one secret environment variable.
type SecretEnv struct {
	Key   string `json:"key"`
	Value Secret `json:"value"`
}

// Network modes.
const (
	NetworkStatic = "static"
	NetworkDHCP   = "dhcp"
	// NetworkNone: the guest has no interface to configure; the agent
	// brings up the loopback only (an AppVM without a network).
	NetworkNone = "none"
)

// Network is the guest's IPv4 configuration.
type Network struct {
	Mode string `json:"mode"`
	// Interface defaults to the first non-loopback link.
	Interface string   `json:"interface,omitempty"`
	IP        string   `json:"ip,omitempty"`
	Prefix    int      `json:"prefix,omitempty"`
	Gateway   string   `json:"gateway,omitempty"`
	DNS       []string `json:"dns,omitempty"`
}

// HostEntry is one extra /etc/hosts line.
type HostEntry struct {
	Host string `json:"host"`
	IP   string `json:"ip"`
}

// ConfigFile is a non-secret file written into the workload root.
type ConfigFile struct {
	Path    string `json:"path"`
	Mode    uint32 `json:"mode"`
	Content string `json:"content"`
}

// SecretFile is a secret file written into the workload root.
type SecretFile struct {
	Path    string `json:"path"`
	Mode    uint32 `json:"mode"`
	Content Secret `json:"content"`
}

// TmpfsMount is a tmpfs mounted inside the workload root.
type TmpfsMount struct {
	Path string `json:"path"`
	// SizeBytes 0 means the kernel default (half of RAM).
	SizeBytes uint64 `json:"size_bytes,omitempty"`
	// Mode 0 means 01777.
	Mode uint32 `json:"mode,omitempty"`
}

// DataMount is an ext4 data volume mounted inside the workload root.
type DataMount struct {
	Device     string `json:"device"`
	Mountpoint string `json:"mountpoint"`
	ReadOnly   bool   `json:"read_only,omitempty"`
}

// Mount asks the guest to mount the ext4 volume of the virtio-blk device
// at PCI address BDF (as Cloud Hypervisor reported it on hot-plug) at
// Mountpoint inside the workload root. The guest waits for the device to
// appear. A Mount of a mountpoint that already holds that device succeeds
// (a host retrying after a restart).
type Mount struct {
	Seq        uint64 `json:"seq"`
	BDF        string `json:"bdf"`
	Mountpoint string `json:"mountpoint"`
	ReadOnly   bool   `json:"read_only,omitempty"`
}

// Unmount asks the guest to unmount Mountpoint (a data volume about to be
// unplugged). A mountpoint that holds nothing succeeds.
type Unmount struct {
	Seq        uint64 `json:"seq"`
	Mountpoint string `json:"mountpoint"`
}

// MountResult answers the Mount or Unmount with the same Seq: Error is
// empty on success; Busy reports an unmount refused because the file
// system is in use (EBUSY), with the mount left in place.
type MountResult struct {
	Seq   uint64 `json:"seq"`
	Error string `json:"error,omitempty"`
	Busy  bool   `json:"busy,omitempty"`
}

// Health-check types.
const (
	CheckExec = "exec"
	CheckHTTP = "http"
	CheckTCP  = "tcp"
)

// Healthcheck describes the workload's health check. Defaults (zero fields):
// interval 30 s, timeout 30 s, retries 3, start period 0, TCP host 127.0.0.1.
type Healthcheck struct {
	Type string `json:"type"`
	// Command is run like the workload (same root, user, env); exit 0 is healthy.
	Command []string `json:"command,omitempty"`
	// URL is fetched with GET; a 2xx or 3xx status is healthy.
	URL string `json:"url,omitempty"`
	// Host and Port are dialed over TCP; a connection is healthy.
	Host            string `json:"host,omitempty"`
	Port            int    `json:"port,omitempty"`
	IntervalSecs    int    `json:"interval_secs,omitempty"`
	TimeoutSecs     int    `json:"timeout_secs,omitempty"`
	Retries         int    `json:"retries,omitempty"`
	StartPeriodSecs int    `json:"start_period_secs,omitempty"`
}

// Stop asks the guest to stop the workload (SIGTERM, then SIGKILL after
// GraceSecs, 0 meaning the Spec's StopGraceSecs) and then power off,
// whatever Keepalive says.
type Stop struct {
	GraceSecs int `json:"grace_secs,omitempty"`
}

// ExitAck tells the guest that the host recorded the workload's end (its
// Exit or Fatal): a guest without Keepalive may power off now.
type ExitAck struct{}

// Heartbeat is sent at the heartbeat interval from Hello on.
type Heartbeat struct {
	Seq uint64    `json:"seq"`
	At  time.Time `json:"at"`
}

// Lease is the DHCP lease the guest obtained (sent on each bind and renewal).
type Lease struct {
	IP      string   `json:"ip"`
	Prefix  int      `json:"prefix"`
	Gateway string   `json:"gateway,omitempty"`
	DNS     []string `json:"dns,omitempty"`
	Search  []string `json:"search,omitempty"`
	// LeaseSecs 0 means infinite or unknown.
	LeaseSecs uint32 `json:"lease_secs,omitempty"`
	Hostname  string `json:"hostname,omitempty"`
}

// Started reports that the workload process is running.
type Started struct {
	PID int `json:"pid"`
}

// Exit reports the end of the workload: exactly one of Code (exited) and
// Signal (killed by that signal number) is set.
type Exit struct {
	Code   *int `json:"code,omitempty"`
	Signal int  `json:"signal,omitempty"`
}

// Fatal reports a guest-side failure to set up or start the workload.
type Fatal struct {
	Message string `json:"message"`
}

// Health statuses.
const (
	HealthStarting  = "starting"
	HealthHealthy   = "healthy"
	HealthUnhealthy = "unhealthy"
)

// Health is sent when the status or the failing streak changes.
type Health struct {
	Status string `json:"status"`
	// Streak counts consecutive failed checks (0 after a success).
	Streak int `json:"streak,omitempty"`
	// Output of the last check, at most MaxHealthOutput bytes.
	Output string `json:"output,omitempty"`
}

// Log streams.
const (
	Stdout = "stdout"
	Stderr = "stderr"
)

// Log is a chunk of workload output.
type Log struct {
	Stream string `json:"stream"`
	// Data is at most MaxLogChunk bytes (base64 in JSON: output need not be UTF-8).
	Data []byte `json:"data"`
	// Seq counts Log messages from 1, across both streams, within one
	// BootID: the order of the output, and (version 3) the key of the
	// host's acknowledgement and of its deduplication after a replay.
	Seq uint64 `json:"seq"`
	// At (version 3) is when the guest read the chunk, so that a chunk
	// replayed after an outage keeps its time; zero (absent) for hosts of
	// older versions.
	At time.Time `json:"at,omitzero"`
}

// LogAck (host, version 3) says that the host stored every Log up to Seq:
// the guest forgets them and does not replay them.
type LogAck struct {
	Seq uint64 `json:"seq"`
}

// Type returns "hello".
func (*Hello) Type() string { return "hello" }

// Type returns "spec".
func (*Spec) Type() string { return "spec" }

// Type returns "stop".
func (*Stop) Type() string { return "stop" }

// Type returns "exit_ack".
func (*ExitAck) Type() string { return "exit_ack" }

// Type returns "mount".
func (*Mount) Type() string { return "mount" }

// Type returns "unmount".
func (*Unmount) Type() string { return "unmount" }

// Type returns "mount_result".
func (*MountResult) Type() string { return "mount_result" }

// Type returns "heartbeat".
func (*Heartbeat) Type() string { return "heartbeat" }

// Type returns "lease".
func (*Lease) Type() string { return "lease" }

// Type returns "started".
func (*Started) Type() string { return "started" }

// Type returns "exit".
func (*Exit) Type() string { return "exit" }

// Type returns "fatal".
func (*Fatal) Type() string { return "fatal" }

// Type returns "health".
func (*Health) Type() string { return "health" }

// Type returns "log".
func (*Log) Type() string { return "log" }

// Type returns "log_ack".
func (*LogAck) Type() string { return "log_ack" }

// newMessage returns an empty message for a type name, or nil.
func newMessage(typ string) Message {
	switch typ {
	case "hello":
		return new(Hello)
	case "spec":
		return new(Spec)
	case "stop":
		return new(Stop)
	case "exit_ack":
		return new(ExitAck)
	case "mount":
		return new(Mount)
	case "unmount":
		return new(Unmount)
	case "mount_result":
		return new(MountResult)
	case "heartbeat":
		return new(Heartbeat)
	case "lease":
		return new(Lease)
	case "started":
		return new(Started)
	case "exit":
		return new(Exit)
	case "fatal":
		return new(Fatal)
	case "health":
		return new(Health)
	case "log":
		return new(Log)
	case "log_ack":
		return new(LogAck)
	}
	return nil
}

// Validate checks the version, and that LogSeq comes only with Resume
// from a guest of version 4 on.
func (m *Hello) Validate() error {
	if m.V < MinVersion || m.V > Version {
		return fmt.Errorf("hello: version %d, want %d to %d", m.V, MinVersion, Version)
	}
	if m.LogSeq != nil && (!m.Resume || m.V < Version4) {
		return fmt.Errorf("hello: log_seq only in a resume of version %d on", Version4)
	}
	return nil
}

// Validate checks the version and the enums, addresses and paths.
func (m *Spec) Validate() error {
	if m.V < MinVersion || m.V > Version {
		return fmt.Errorf("spec: version %d, want %d to %d", m.V, MinVersion, Version)
	}
	if len(m.Entrypoint)+len(m.Command) == 0 {
		return errors.New("spec: empty command")
	}
	switch m.Network.Mode {
	case NetworkStatic:
		a, err := netip.ParseAddr(m.Network.IP)
		if err != nil || !a.Is4() {
			return fmt.Errorf("spec: network.ip %q is not an IPv4 address", m.Network.IP)
		}
		if m.Network.Prefix < 1 || m.Network.Prefix > 32 {
			return fmt.Errorf("spec: network.prefix %d out of 1..32", m.Network.Prefix)
		}
		if m.Network.Gateway != "" {
			if g, err := netip.ParseAddr(m.Network.Gateway); err != nil || !g.Is4() {
				return fmt.Errorf("spec: network.gateway %q is not an IPv4 address", m.Network.Gateway)
			}
		}
	case NetworkDHCP, NetworkNone:
	default:
		return fmt.Errorf("spec: unknown network.mode %q", m.Network.Mode)
	}
	for _, d := range m.Network.DNS {
		if _, err := netip.ParseAddr(d); err != nil {
			return fmt.Errorf("spec: network.dns %q is not an IP address", d)
		}
	}
	for _, h := range m.ExtraHosts {
		if _, err := netip.ParseAddr(h.IP); err != nil || h.Host == "" {
			return fmt.Errorf("spec: extra_hosts entry %q %q is not a host and an IP", h.Host, h.IP)
		}
	}
	for _, f := range m.ConfigFiles {
		if err := checkPath("config_files", f.Path); err != nil {
			return fmt.Errorf("spec: %w", err)
		}
	}
	for _, f := range m.SecretFiles {
		if err := checkPath("secret_files", f.Path); err != nil {
			return fmt.Errorf("spec: %w", err)
		}
	}
	for _, t := range m.TmpfsMounts {
		if err := checkPath("tmpfs_mounts", t.Path); err != nil {
			return fmt.Errorf("spec: %w", err)
		}
	}
	for _, d := range m.DataMounts {
		if err := checkPath("data_mounts", d.Mountpoint); err != nil {
			return fmt.Errorf("spec: %w", err)
		}
	}
	if h := m.Healthcheck; h != nil {
		switch h.Type {
		case CheckExec:
			if len(h.Command) == 0 {
				return errors.New("spec: exec healthcheck without a command")
			}
		case CheckHTTP:
			if h.URL == "" {
				return errors.New("spec: http healthcheck without a url")
			}
		case CheckTCP:
			if h.Port < 1 || h.Port > 65535 {
				return fmt.Errorf("spec: tcp healthcheck port %d out of 1..65535", h.Port)
			}
		default:
			return fmt.Errorf("spec: unknown healthcheck type %q", h.Type)
		}
		if h.IntervalSecs < 0 || h.TimeoutSecs < 0 || h.Retries < 0 || h.StartPeriodSecs < 0 {
			return errors.New("spec: negative healthcheck timing")
		}
	}
	if m.StopGraceSecs < 0 || m.HeartbeatSecs < 0 {
		return errors.New("spec: negative stop_grace_secs or heartbeat_secs")
	}
	for _, e := range m.Env {
		k, _, ok := strings.Cut(e, "=")
		if !ok || !ValidEnvKey(k) {
			return fmt.Errorf("spec: env entry with key %q is not KEY=VALUE", k)
		}
	}
	for _, e := range m.SecretEnv {
		if !ValidEnvKey(e.Key) {
			// The key is not secret; the value is never named.
			return fmt.Errorf("spec: secret_env key %q is not a valid name", e.Key)
		}
	}
	return nil
}

// ValidEnvKey reports whether k is an environment variable name: it
// matches [A-Za-z_][A-Za-z0-9_]*, the rule of the create request too.
func ValidEnvKey(k string) bool {
	if k == "" {
		return false
	}
	for i, c := range k {
		switch {
		case c == '_', c >= 'A' && c <= 'Z', c >= 'a' && c <= 'z':
		case c >= '0' && c <= '9' && i > 0:
		default:
			return false
		}
	}
	return true
}

// checkPath accepts absolute, clean paths other than /.
func checkPath(field, p string) error {
	if len(p) < 2 || p[0] != '/' || p[len(p)-1] == '/' {
		return fmt.Errorf("%s path %q is not an absolute file path", field, p)
	}
	for i := 0; i < len(p); {
		j := i + 1
		for j < len(p) && p[j] != '/' {
			j++
		}
		seg := p[i+1 : j]
		if seg == "" || seg == "." || seg == ".." {
			return fmt.Errorf("%s path %q has an empty, . or .. segment", field, p)
		}
		i = j
	}
	for _, c := range []byte(p) {
		if c < 0x20 || c == 0x7f {
			return fmt.Errorf("%s path %q has a control character", field, p)
		}
	}
	return nil
}

// Validate accepts any Stop with a non-negative grace.
func (m *Stop) Validate() error {
	if m.GraceSecs < 0 {
		return errors.New("stop: negative grace_secs")
	}
	return nil
}

// Validate accepts the acknowledgement.
func (m *ExitAck) Validate() error { return nil }

// Validate checks the PCI address and the mountpoint.
func (m *Mount) Validate() error {
	if !ValidBDF(m.BDF) {
		return fmt.Errorf("mount: %q is not a PCI address (DDDD:BB:SS.F)", m.BDF)
	}
	if err := checkPath("mount", m.Mountpoint); err != nil {
		return fmt.Errorf("mount: %w", err)
	}
	return nil
}

// Validate checks the mountpoint.
func (m *Unmount) Validate() error {
	if err := checkPath("unmount", m.Mountpoint); err != nil {
		return fmt.Errorf("unmount: %w", err)
	}
	return nil
}

// Validate checks that only a failure is busy.
func (m *MountResult) Validate() error {
	if m.Busy && m.Error == "" {
		return errors.New("mount_result: busy without an error")
	}
	return nil
}

// ValidBDF reports whether s is a PCI address in sysfs form,
// "0000:00:05.0": four, two and two lowercase hex digits, and a function
// 0 to 7. The guest builds a sysfs path from it, so nothing else may pass.
func ValidBDF(s string) bool {
	if len(s) != 12 || s[4] != ':' || s[7] != ':' || s[10] != '.' || s[11] < '0' || s[11] > '7' {
		return false
	}
	for i, c := range []byte(s[:10]) {
		if i == 4 || i == 7 {
			continue
		}
		if !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f') {
			return false
		}
	}
	return true
}

// Validate accepts any heartbeat.
func (m *Heartbeat) Validate() error { return nil }

// Validate checks the address and prefix.
func (m *Lease) Validate() error {
	a, err := netip.ParseAddr(m.IP)
	if err != nil || !a.Is4() {
		return fmt.Errorf("lease: ip %q is not an IPv4 address", m.IP)
	}
	if m.Prefix < 0 || m.Prefix > 32 {
		return fmt.Errorf("lease: prefix %d out of 0..32", m.Prefix)
	}
	return nil
}

// Validate checks the pid.
func (m *Started) Validate() error {
	if m.PID <= 0 {
		return fmt.Errorf("started: pid %d", m.PID)
	}
	return nil
}

// Validate checks that exactly one of Code and Signal is set.
func (m *Exit) Validate() error {
	if (m.Code == nil) == (m.Signal == 0) {
		return errors.New("exit: want exactly one of code and signal")
	}
	if m.Signal < 0 || (m.Code != nil && (*m.Code < 0 || *m.Code > 255)) {
		return errors.New("exit: code or signal out of range")
	}
	return nil
}

// Validate accepts any fatal message.
func (m *Fatal) Validate() error { return nil }

// Validate checks the status and sizes.
func (m *Health) Validate() error {
	switch m.Status {
	case HealthStarting, HealthHealthy, HealthUnhealthy:
	default:
		return fmt.Errorf("health: unknown status %q", m.Status)
	}
	if m.Streak < 0 || len(m.Output) > MaxHealthOutput {
		return errors.New("health: negative streak or output too long")
	}
	return nil
}

// Validate checks the stream and chunk size.
func (m *Log) Validate() error {
	if m.Stream != Stdout && m.Stream != Stderr {
		return fmt.Errorf("log: unknown stream %q", m.Stream)
	}
	if len(m.Data) > MaxLogChunk {
		return fmt.Errorf("log: chunk of %d bytes exceeds %d", len(m.Data), MaxLogChunk)
	}
	return nil
}

// Validate accepts any acknowledgement.
func (m *LogAck) Validate() error { return nil }

// Conn sends and receives messages over a byte stream. Send is safe for
// concurrent use; Recv must be called from one goroutine at a time.
type Conn struct {
	rw  io.ReadWriter
	wmu sync.Mutex
	hdr [4]byte
}

// NewConn wraps rw. Closing rw is the caller's job.
func NewConn(rw io.ReadWriter) *Conn { return &Conn{rw: rw} }

// Send validates m and writes it as one frame.
func (c *Conn) Send(m Message) error {
	b, err := Marshal(m)
	if err != nil {
		return err
	}
	c.wmu.Lock()
	defer c.wmu.Unlock()
	if _, err := c.rw.Write(b); err != nil {
		return fmt.Errorf("sending %s: %w", m.Type(), err)
	}
	return nil
}

// Marshal validates m and returns its frame (length prefix included).
func Marshal(m Message) ([]byte, error) {
	if err := m.Validate(); err != nil {
		return nil, fmt.Errorf("encoding %s: %w", m.Type(), err)
	}
	body, err := json.Marshal(m)
	if err != nil {
		return nil, fmt.Errorf("encoding %s: %w", m.Type(), err)
	}
	// The envelope is assembled by hand: type names are plain ASCII, and
	// json.Marshal of a RawMessage would scan the whole body again.
	typ := m.Type()
	n := len(`{"type":"","body":}`) + len(typ) + len(body)
	if n > MaxFrame {
		return nil, fmt.Errorf("encoding %s: %d bytes: %w", typ, n, ErrFrameTooLarge)
	}
	b := make([]byte, 4, 4+n)
	binary.BigEndian.PutUint32(b, uint32(n))
	b = append(b, `{"type":"`...)
	b = append(b, typ...)
	b = append(b, `","body":`...)
	b = append(b, body...)
	return append(b, '}'), nil
}

// Recv reads one frame and returns its message, a pointer to one of this
// package's types. A clean end of stream before a frame is io.EOF; a stream
// cut inside a frame is io.ErrUnexpectedEOF.
func (c *Conn) Recv() (Message, error) {
	if _, err := io.ReadFull(c.rw, c.hdr[:]); err != nil {
		return nil, err
	}
	n := binary.BigEndian.Uint32(c.hdr[:])
	if n > MaxFrame {
		return nil, fmt.Errorf("receiving: %d bytes: %w", n, ErrFrameTooLarge)
	}
	b := make([]byte, n)
	if _, err := io.ReadFull(c.rw, b); err != nil {
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		return nil, fmt.Errorf("receiving: %w", err)
	}
	return Unmarshal(b)
}

// Unmarshal decodes one envelope (without the length prefix), strictly.
// When "type" comes before "body" (as Marshal writes it) the body is decoded
// straight into its message, in one pass over the frame.
func Unmarshal(b []byte) (Message, error) {
	d := json.NewDecoder(bytes.NewReader(b))
	d.DisallowUnknownFields()
	if tok, err := d.Token(); err != nil {
		return nil, fmt.Errorf("decoding envelope: %w", err)
	} else if tok != json.Delim('{') {
		return nil, errors.New("decoding envelope: not a JSON object")
	}
	var (
		typ              string
		m                Message
		raw              json.RawMessage
		haveType, isNull bool
		haveBody         bool
	)
	for d.More() {
		tok, err := d.Token()
		if err != nil {
			return nil, fmt.Errorf("decoding envelope: %w", err)
		}
		switch key, _ := tok.(string); key {
		case "type":
			if haveType {
				return nil, errors.New("decoding envelope: duplicate type")
			}
			haveType = true
			if err := d.Decode(&typ); err != nil {
				return nil, fmt.Errorf("decoding envelope: %w", err)
			}
			if m = newMessage(typ); m == nil {
				return nil, fmt.Errorf("decoding: unknown message type %q", typ)
			}
		case "body":
			if haveBody {
				return nil, errors.New("decoding envelope: duplicate body")
			}
			haveBody = true
			isNull = nullAt(b, d.InputOffset())
			if m != nil && !isNull {
				if err := d.Decode(m); err != nil {
					return nil, fmt.Errorf("decoding %s: %w", typ, err)
				}
			} else if err := d.Decode(&raw); err != nil {
				return nil, fmt.Errorf("decoding envelope: %w", err)
			}
		default:
			return nil, fmt.Errorf("decoding envelope: unknown field %q", key)
		}
	}
	if _, err := d.Token(); err != nil {
		return nil, fmt.Errorf("decoding envelope: %w", err)
	}
	if _, err := d.Token(); err != io.EOF {
		return nil, errors.New("decoding envelope: trailing data after the JSON value")
	}
	if !haveType {
		return nil, errors.New("decoding: unknown message type \"\"")
	}
	if !haveBody || isNull {
		return nil, fmt.Errorf("decoding %s: missing body", typ)
	}
	if raw != nil {
		// The body came before the type.
		if err := decodeStrict(raw, m); err != nil {
			return nil, fmt.Errorf("decoding %s: %w", typ, err)
		}
	}
	if err := m.Validate(); err != nil {
		return nil, fmt.Errorf("decoding %s: %w", typ, err)
	}
	return m, nil
}

// nullAt reports whether the JSON value after the key ending at off is null.
func nullAt(b []byte, off int64) bool {
	rest := b[off:]
	for len(rest) > 0 && (rest[0] == ' ' || rest[0] == '\t' || rest[0] == '\n' || rest[0] == '\r' || rest[0] == ':') {
		rest = rest[1:]
	}
	return bytes.HasPrefix(rest, []byte("null"))
}

// decodeStrict decodes one JSON value with unknown fields and trailing data
// refused.
func decodeStrict(b []byte, v any) error {
	d := json.NewDecoder(bytes.NewReader(b))
	d.DisallowUnknownFields()
	if err := d.Decode(v); err != nil {
		return err
	}
	if _, err := d.Token(); err != io.EOF {
		return errors.New("trailing data after the JSON value")
	}
	return nil
}
