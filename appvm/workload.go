package appvm

import (
	"fmt"
	"net/netip"
	"path"
	"strings"
	"unicode/utf8"

	"vmhost/appvm/guest/proto"
	"vmhost/vm"
)

// The editable workload spec beyond env and keepalive (docs/api.md, AppVMs):
// the argument vector, working directory, user, health check, /etc/hosts
// entries, config and secret files, tmpfs mounts and the stop grace. A
// create may give any of them; the record keeps them (secret file contents
// in its secrets), the views show them (secret contents never), and the
// guest agent applies them at every boot before the workload starts.

// SecretFileRequest is one secret file of a request: its content goes to
// the record's secrets and the guest only.
type SecretFileRequest struct {
	Path    string    `json:"path" decode:"required"`
	Mode    uint32    `json:"mode,omitempty"`
	Content vm.Secret `json:"content" decode:"required"`
}

// Limits of the workload spec.
const (
	MaxInjectedFiles      = 64      // config and secret files together
	MaxInjectedFileBytes  = 1 << 20 // one file's content
	MaxInjectedTotalBytes = 4 << 20 // every file's content together
	MaxExtraHosts         = 64
	MaxTmpfsMounts        = 16
	MaxCommandEntries     = 256
	MaxStopGraceSecs      = 3600
	defaultFileMode       = 0o644
	defaultSecretFileMode = 0o400
)

// workloadSpec is the editable part of a request, as create and edits
// give it (nil or empty: not given).
type workloadSpec struct {
	Command       []string
	Workdir       string
	User          string
	NoHealthcheck bool
	Healthcheck   *vm.Healthcheck
	ExtraHosts    []vm.ExtraHost
	ConfigFiles   []vm.ConfigFile
	SecretFiles   []SecretFileRequest
	TmpfsMounts   []vm.TmpfsMount
	StopGraceSecs *uint32
}

func (r *CreateRequest) workload() workloadSpec {
	return workloadSpec{Command: r.Command, Workdir: r.Workdir, User: r.User, NoHealthcheck: r.NoHealthcheck,
		Healthcheck: r.Healthcheck, ExtraHosts: r.ExtraHosts, ConfigFiles: r.ConfigFiles, SecretFiles: r.SecretFiles,
		TmpfsMounts: r.TmpfsMounts, StopGraceSecs: r.StopGraceSecs}
}

// checkGuestPath is the rule of every guest path: absolute, clean, no
// "..", not the root, at most MaxMountpoint bytes.
func checkGuestPath(p string) error {
	switch {
	case p == "":
		return fmt.Errorf("must not be empty")
	case len(p) > MaxMountpoint:
		return fmt.Errorf("at most %d bytes", MaxMountpoint)
	case !strings.HasPrefix(p, "/"):
		return fmt.Errorf("must be an absolute path")
	case p == "/":
		return fmt.Errorf("must not be /")
	case strings.ContainsRune(p, 0) || !utf8.ValidString(p):
		return fmt.Errorf("must be UTF-8 text without NUL")
	case path.Clean(p) != p || strings.Contains(p, "/../") || strings.HasSuffix(p, "/.."):
		return fmt.Errorf("must be a clean path without . or .. elements")
	}
	return nil
}

// validate checks the workload spec; messages never hold a file's content.
func (w workloadSpec) validate() error {
	if len(w.Command) > MaxCommandEntries {
		return bad("command", "at most %d entries, got %d", MaxCommandEntries, len(w.Command))
	}
	for i, a := range w.Command {
		if strings.ContainsRune(a, 0) {
			return bad(fmt.Sprintf("command[%d]", i), "must not contain NUL")
		}
	}
	if w.Workdir != "" {
		if err := checkGuestPath(w.Workdir); err != nil && w.Workdir != "/" {
			return bad("workdir", "%s", err)
		}
	}
	if strings.ContainsAny(w.User, " \t\n\x00") || strings.Count(w.User, ":") > 1 || len(w.User) > 256 {
		return bad("user", `must be "name", "uid", "name:group" or "uid:gid"`)
	}
	if w.NoHealthcheck && w.Healthcheck != nil {
		return bad("healthcheck", "must be absent when no_healthcheck is true")
	}
	if h := w.Healthcheck; h != nil {
		switch {
		case len(h.Test) < 2 || (h.Test[0] != "CMD" && h.Test[0] != "CMD-SHELL"):
			return bad("healthcheck.test", `must be ["CMD", argv...] or ["CMD-SHELL", "command"]`)
		case h.Test[0] == "CMD-SHELL" && len(h.Test) != 2:
			return bad("healthcheck.test", `CMD-SHELL takes one command string`)
		case h.IntervalSecs == 0:
			return bad("healthcheck.interval_secs", "must be positive")
		case h.TimeoutSecs == 0:
			return bad("healthcheck.timeout_secs", "must be positive")
		case h.Retries == 0:
			return bad("healthcheck.retries", "must be positive")
		}
	}
	if len(w.ExtraHosts) > MaxExtraHosts {
		return bad("extra_hosts", "at most %d entries, got %d", MaxExtraHosts, len(w.ExtraHosts))
	}
	for i, h := range w.ExtraHosts {
		f := func(n string) string { return fmt.Sprintf("extra_hosts[%d].%s", i, n) }
		if !validHostName(h.Hostname) {
			return bad(f("hostname"), "must be a host name (labels of letters, digits and -, dot-separated, at most 253 bytes)")
		}
		if _, err := netip.ParseAddr(h.IP); err != nil {
			return bad(f("ip"), "not an IP address")
		}
	}
	if n := len(w.ConfigFiles) + len(w.SecretFiles); n > MaxInjectedFiles {
		return bad("config_files", "at most %d config and secret files together, got %d", MaxInjectedFiles, n)
	}
	paths := map[string]string{}
	total := 0
	file := func(field, p string, mode uint32, size int) error {
		if err := checkGuestPath(p); err != nil {
			return bad(field+".path", "%s", err)
		}
		if other, dup := paths[p]; dup {
			return bad(field+".path", "%s is also %s", p, other)
		}
		paths[p] = field
		if mode > 0o7777 {
			return bad(field+".mode", "must be at most 0o7777 (4095), got %d", mode)
		}
		if size > MaxInjectedFileBytes {
			return bad(field+".content", "at most %d bytes, got %d", MaxInjectedFileBytes, size)
		}
		total += size
		if total > MaxInjectedTotalBytes {
			return bad(field+".content", "config and secret files hold at most %d bytes together", MaxInjectedTotalBytes)
		}
		return nil
	}
	for i, c := range w.ConfigFiles {
		field := fmt.Sprintf("config_files[%d]", i)
		if !utf8.ValidString(c.Content) {
			return bad(field+".content", "must be UTF-8 text")
		}
		if err := file(field, c.Path, c.Mode, len(c.Content)); err != nil {
			return err
		}
	}
	for i, s := range w.SecretFiles {
		if err := file(fmt.Sprintf("secret_files[%d]", i), s.Path, s.Mode, len(s.Content.Reveal())); err != nil {
			return err
		}
	}
	if len(w.TmpfsMounts) > MaxTmpfsMounts {
		return bad("tmpfs_mounts", "at most %d mounts, got %d", MaxTmpfsMounts, len(w.TmpfsMounts))
	}
	for i, t := range w.TmpfsMounts {
		f := func(n string) string { return fmt.Sprintf("tmpfs_mounts[%d].%s", i, n) }
		if err := checkGuestPath(t.Path); err != nil {
			return bad(f("path"), "%s", err)
		}
		if other, dup := paths[t.Path]; dup {
			return bad(f("path"), "%s is also %s", t.Path, other)
		}
		paths[t.Path] = fmt.Sprintf("tmpfs_mounts[%d]", i)
		if t.SizeMB > 1<<20 {
			return bad(f("size_mb"), "at most %d, got %d", 1<<20, t.SizeMB)
		}
		if t.Mode > 0o7777 {
			return bad(f("mode"), "must be at most 0o7777 (4095), got %d", t.Mode)
		}
	}
	if g := w.StopGraceSecs; g != nil && (*g < 1 || *g > MaxStopGraceSecs) {
		return bad("stop_grace_secs", "must be 1..%d, got %d", MaxStopGraceSecs, *g)
	}
	return nil
}

// validHostName reports whether h is a DNS name of dot-separated labels.
func validHostName(h string) bool {
	if h == "" || len(h) > 253 {
		return false
	}
	for _, l := range strings.Split(h, ".") {
		if !vm.ValidHostname(l) {
			return false
		}
	}
	return true
}

// apply stores w in the record's AppVM spec and secrets.
func (w workloadSpec) apply(a *vm.AppVMSpec, secrets *vm.Secrets) {
	a.Command, a.Workdir, a.User = w.Command, w.Workdir, w.User
	a.NoHealthcheck, a.Healthcheck = w.NoHealthcheck, w.Healthcheck
	a.ExtraHosts, a.TmpfsMounts = w.ExtraHosts, w.TmpfsMounts
	a.ConfigFiles = nil
	for _, c := range w.ConfigFiles {
		if c.Mode == 0 {
			c.Mode = defaultFileMode
		}
		a.ConfigFiles = append(a.ConfigFiles, c)
	}
	secrets.Files = nil
	for _, s := range w.SecretFiles {
		mode := s.Mode
		if mode == 0 {
			mode = defaultSecretFileMode
		}
		secrets.Files = append(secrets.Files, vm.SecretFile{Path: s.Path, Mode: mode, Content: s.Content})
	}
	a.StopGraceSecs = 0
	if w.StopGraceSecs != nil {
		a.StopGraceSecs = *w.StopGraceSecs
	}
}

// effectiveArgs, effectiveWorkdir, effectiveUser and effectiveHealthcheck
// are the image's defaults overlaid with the spec.
func effectiveArgs(a *vm.AppVMSpec) (entrypoint, cmd []string) {
	switch {
	case a.Keepalive:
		return nil, KeepaliveArgs
	case len(a.Command) > 0:
		return nil, a.Command
	}
	return a.Image.Entrypoint, a.Image.Cmd
}

func effectiveWorkdir(a *vm.AppVMSpec) string {
	if a.Workdir != "" {
		return a.Workdir
	}
	return a.Image.Workdir
}

func effectiveUser(a *vm.AppVMSpec) string {
	if a.User != "" {
		return a.User
	}
	return a.Image.User
}

func effectiveHealthcheck(a *vm.AppVMSpec) *vm.Healthcheck {
	switch {
	case a.NoHealthcheck:
		return nil
	case a.Healthcheck != nil:
		return a.Healthcheck
	}
	return a.Image.Healthcheck
}

// guestFiles adds the spec's hosts, files and mounts to the guest's Spec.
func guestFiles(rec *vm.Record, sp *proto.Spec) {
	a := rec.AppVM
	for _, h := range a.ExtraHosts {
		sp.ExtraHosts = append(sp.ExtraHosts, proto.HostEntry{Host: h.Hostname, IP: h.IP})
	}
	for _, c := range a.ConfigFiles {
		sp.ConfigFiles = append(sp.ConfigFiles, proto.ConfigFile{Path: c.Path, Mode: c.Mode, Content: c.Content})
	}
	for _, s := range rec.Secrets.Files {
		sp.SecretFiles = append(sp.SecretFiles, proto.SecretFile{Path: s.Path, Mode: s.Mode, Content: proto.NewSecret(s.Content.Reveal())})
	}
	for _, t := range a.TmpfsMounts {
		sp.TmpfsMounts = append(sp.TmpfsMounts, proto.TmpfsMount{Path: t.Path, SizeBytes: t.SizeMB << 20, Mode: t.Mode})
	}
	if a.StopGraceSecs > 0 {
		sp.StopGraceSecs = int(a.StopGraceSecs)
	}
}
