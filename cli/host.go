package cli

import (
	"encoding/json"
	"fmt"
	"net/url"
	"strconv"
	"strings"
	"time"
)

// get does GET path and prints the answer: as is with -o json, else
// through table, which decodes it.
func (e *env) get(path string, table func([]byte) error) error {
	if err := e.connect(); err != nil {
		return err
	}
	_, b, err := e.client.do(e.ctx, "GET", path, nil)
	if err != nil {
		return err
	}
	if e.opts.output == "json" {
		e.raw(b)
		return nil
	}
	return table(b)
}

// verb checks a command's subcommand and its number of arguments, from a
// table of verb → argument count.
func (e *env) verb(cmd string, args []string, verbs map[string]int, order string) (string, []string, error) {
	if len(args) == 0 {
		return "", nil, usageError("%s: no subcommand (%s)", cmd, order)
	}
	sub := args[0]
	n, ok := verbs[sub]
	if !ok {
		return "", nil, usageError("%s: unknown subcommand %q", cmd, sub)
	}
	pos, err := e.parse(cmd+" "+sub, args[1:], nil)
	if err != nil {
		return "", nil, err
	}
	if len(pos) != n {
		return "", nil, usageError("%s %s: want %d argument(s), got %d", cmd, sub, n, len(pos))
	}
	return sub, pos, nil
}

// registryImage holds the fields of a RegistryImage the table shows.
type registryImage struct {
	ImageID  string `json:"image_id"`
	Distro   string `json:"distro"`
	Version  string `json:"version"`
	Arch     string `json:"arch"`
	Size     int64  `json:"size_bytes"`
	Cached   bool   `json:"cached"`
	FetchURL string `json:"fetch_url"`
}

func (e *env) registryTable(imgs []registryImage) {
	tw := newTable(e.stdout)
	fmt.Fprintln(tw, "IMAGE ID\tDISTRO\tVERSION\tARCH\tSIZE\tCACHED\tFETCH URL")
	for _, i := range imgs {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%t\t%s\n", i.ImageID, dash(i.Distro), dash(i.Version), dash(i.Arch), sizeOrDash(i.Size), i.Cached, i.FetchURL)
	}
	tw.Flush()
}

func sizeOrDash(n int64) string {
	if n <= 0 {
		return "-"
	}
	return bytesSize(n)
}

// registryCmd runs `vmhost registry list|get ID`.
func (e *env) registryCmd(args []string) error {
	sub, pos, err := e.verb("registry", args, map[string]int{"list": 0, "get": 1}, "list, get")
	if err != nil {
		return err
	}
	if sub == "list" {
		return e.get("/api/registry/images", func(b []byte) error {
			var l struct {
				Images []registryImage `json:"images"`
			}
			if err := json.Unmarshal(b, &l); err != nil {
				return fmt.Errorf("decoding the registry images: %w", err)
			}
			e.registryTable(l.Images)
			return nil
		})
	}
	return e.get("/api/registry/images/"+url.PathEscape(pos[0]), func(b []byte) error {
		var i registryImage
		if err := json.Unmarshal(b, &i); err != nil {
			return fmt.Errorf("decoding the registry image: %w", err)
		}
		e.registryTable([]registryImage{i})
		return nil
	})
}

// cacheCmd runs `vmhost cache list|delete DIGEST` over the verified image
// cache.
func (e *env) cacheCmd(args []string) error {
	sub, pos, err := e.verb("cache", args, map[string]int{"list": 0, "delete": 1}, "list, delete")
	if err != nil {
		return err
	}
	if sub == "delete" {
		if err := e.connect(); err != nil {
			return err
		}
		if _, _, err := e.client.do(e.ctx, "DELETE", "/api/images/cache/"+url.PathEscape(pos[0]), nil); err != nil {
			return err
		}
		e.done(pos[0] + ": deleted")
		return nil
	}
	return e.get("/api/images/cache", func(b []byte) error {
		var l struct {
			Images []struct {
				Digest     string     `json:"digest"`
				Size       int64      `json:"size_bytes"`
				LastUsedAt *time.Time `json:"last_used_at"`
				InUse      bool       `json:"in_use"`
				Registry   []string   `json:"registry_image_ids"`
			} `json:"images"`
		}
		if err := json.Unmarshal(b, &l); err != nil {
			return fmt.Errorf("decoding the image cache: %w", err)
		}
		tw := newTable(e.stdout)
		fmt.Fprintln(tw, "DIGEST\tSIZE\tLAST USED\tIN USE\tREGISTRY IMAGES")
		for _, i := range l.Images {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%t\t%s\n", i.Digest, sizeOrDash(i.Size), age(e.now, i.LastUsedAt), i.InUse, dash(strings.Join(i.Registry, ",")))
		}
		tw.Flush()
		return nil
	})
}

// networkCmd runs `vmhost network list`: each network, and its bridge as
// the host has it now.
func (e *env) networkCmd(args []string) error {
	if _, _, err := e.verb("network", args, map[string]int{"list": 0}, "list"); err != nil {
		return err
	}
	return e.get("/api/networks", func(b []byte) error {
		var l struct {
			Networks []struct {
				ID         string `json:"id"`
				Bridge     string `json:"bridge"`
				MTU        int    `json:"mtu"`
				Isolated   bool   `json:"isolated"`
				SpoofGuard bool   `json:"spoof_guard"`
				Default    bool   `json:"default"`
				State      struct {
					Exists   bool `json:"exists"`
					IsBridge bool `json:"is_bridge"`
					Up       bool `json:"up"`
					Ports    int  `json:"ports"`
				} `json:"bridge_state"`
			} `json:"networks"`
		}
		if err := json.Unmarshal(b, &l); err != nil {
			return fmt.Errorf("decoding the networks: %w", err)
		}
		tw := newTable(e.stdout)
		fmt.Fprintln(tw, "ID\tBRIDGE\tBRIDGE STATE\tPORTS\tDEFAULT\tISOLATED\tSPOOF GUARD\tMTU")
		var missing []string
		for _, n := range l.Networks {
			state := "up"
			switch {
			case !n.State.Exists:
				state = "missing"
				missing = append(missing, n.Bridge)
			case !n.State.IsBridge:
				state = "not a bridge"
			case !n.State.Up:
				state = "down"
			}
			mtu := "-"
			if n.MTU > 0 {
				mtu = strconv.Itoa(n.MTU)
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%t\t%t\t%t\t%s\n", n.ID, n.Bridge, state, n.State.Ports, n.Default, n.Isolated, n.SpoofGuard, mtu)
		}
		tw.Flush()
		for _, br := range missing {
			fmt.Fprintf(e.stdout, "bridge %s is missing: creates on its network fail (on the agent's host: ip link add %s type bridge && ip link set %s up)\n", br, br, br)
		}
		return nil
	})
}

// hostCmd runs `vmhost host` (GET /api/host) and `vmhost host pci`.
func (e *env) hostCmd(args []string) error {
	if len(args) == 0 || strings.HasPrefix(args[0], "-") {
		return e.hostInfo(args)
	}
	if _, _, err := e.verb("host", args, map[string]int{"pci": 0}, "pci"); err != nil {
		return err
	}
	return e.get("/api/host/pci", func(b []byte) error {
		var l struct {
			Devices []struct {
				BDF        string `json:"bdf"`
				Vendor     string `json:"vendor_id"`
				Device     string `json:"device_id"`
				Class      string `json:"class"`
				VendorName string `json:"vendor_name"`
				DeviceName string `json:"device_name"`
				Driver     string `json:"driver"`
				Group      *int   `json:"iommu_group"`
				Ready      bool   `json:"passthrough_ready"`
				ClaimedBy  string `json:"claimed_by"`
			} `json:"devices"`
		}
		if err := json.Unmarshal(b, &l); err != nil {
			return fmt.Errorf("decoding the PCI devices: %w", err)
		}
		tw := newTable(e.stdout)
		fmt.Fprintln(tw, "BDF\tCLASS\tVENDOR:DEVICE\tDRIVER\tIOMMU GROUP\tREADY\tCLAIMED BY\tNAME")
		for _, d := range l.Devices {
			group := "-"
			if d.Group != nil {
				group = strconv.Itoa(*d.Group)
			}
			name := strings.TrimSpace(d.VendorName + " " + d.DeviceName)
			fmt.Fprintf(tw, "%s\t%s\t%s:%s\t%s\t%s\t%t\t%s\t%s\n", d.BDF, d.Class, strings.TrimPrefix(d.Vendor, "0x"), strings.TrimPrefix(d.Device, "0x"),
				dash(d.Driver), group, d.Ready, dash(d.ClaimedBy), dash(name))
		}
		tw.Flush()
		return nil
	})
}

// hostInfo runs `vmhost host`: who the agent is, and what the host can
// still take in the numbers admission decides with.
func (e *env) hostInfo(args []string) error {
	pos, err := e.parse("host", args, nil)
	if err != nil {
		return err
	}
	if len(pos) != 0 {
		return usageError("host: unexpected argument %q", pos[0])
	}
	return e.get("/api/host", func(b []byte) error {
		var h struct {
			Hostname string `json:"hostname"`
			AgentID  string `json:"agent_id"`
			Version  string `json:"version"`
			BootID   string `json:"boot_id"`
			KVM      bool   `json:"kvm"`
			CPUs     struct {
				Online, Allocatable, Used uint64
			} `json:"cpus"`
			MemoryMB struct {
				Total, Allocatable, Used uint64
			} `json:"memory_mb"`
			Disk struct {
				StateTotal uint64 `json:"state_total"`
				StateFree  uint64 `json:"state_free"`
				Committed  uint64 `json:"committed"`
			} `json:"disk_bytes"`
			VMs      map[string]int `json:"vms"`
			Features []string       `json:"features"`
		}
		if err := json.Unmarshal(b, &h); err != nil {
			return fmt.Errorf("decoding the host: %w", err)
		}
		left := func(alloc, used uint64) uint64 { return alloc - min(used, alloc) }
		tw := newTable(e.stdout)
		fmt.Fprintf(tw, "hostname\t%s\n", dash(h.Hostname))
		fmt.Fprintf(tw, "agent id\t%s\n", dash(h.AgentID))
		fmt.Fprintf(tw, "version\t%s\n", dash(h.Version))
		fmt.Fprintf(tw, "boot id\t%s\n", dash(h.BootID))
		fmt.Fprintf(tw, "kvm\t%t\n", h.KVM)
		fmt.Fprintf(tw, "vcpus\t%d free of %d allocatable (%d used; %d host CPUs)\n",
			left(h.CPUs.Allocatable, h.CPUs.Used), h.CPUs.Allocatable, h.CPUs.Used, h.CPUs.Online)
		fmt.Fprintf(tw, "memory\t%s free of %s allocatable (%s used; %s on the host)\n",
			mib(int64(left(h.MemoryMB.Allocatable, h.MemoryMB.Used))), mib(int64(h.MemoryMB.Allocatable)), mib(int64(h.MemoryMB.Used)), mib(int64(h.MemoryMB.Total)))
		fmt.Fprintf(tw, "disk\t%s free for new disks (%s free of %s in the state directory; %s committed)\n",
			bytesSize(int64(left(h.Disk.StateFree, h.Disk.Committed))), bytesSize(int64(h.Disk.StateFree)), bytesSize(int64(h.Disk.StateTotal)), bytesSize(int64(h.Disk.Committed)))
		states := make([]string, 0, len(h.VMs))
		for _, st := range []string{"created", "running", "paused", "stopped", "failed"} {
			states = append(states, fmt.Sprintf("%d %s", h.VMs[st], st))
		}
		fmt.Fprintf(tw, "vms\t%s\n", strings.Join(states, ", "))
		fmt.Fprintf(tw, "features\t%s\n", dash(strings.Join(h.Features, ", ")))
		tw.Flush()
		return nil
	})
}

// textCmd runs `vmhost metrics` (the Prometheus text as served) and
// `vmhost health` (GET /healthz: ok, or why not yet, with exit 1).
func (e *env) textCmd(cmd string, args []string) error {
	pos, err := e.parse(cmd, args, nil)
	if err != nil {
		return err
	}
	if len(pos) != 0 {
		return usageError("%s: unexpected argument %q", cmd, pos[0])
	}
	if err := e.connect(); err != nil {
		return err
	}
	path := "/metrics"
	if cmd == "health" {
		path = "/healthz"
	}
	_, b, err := e.client.do(e.ctx, "GET", path, nil)
	if err != nil {
		return err
	}
	e.raw(b)
	return nil
}
