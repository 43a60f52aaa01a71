package cli

import (
	"encoding/json"
	"flag"
	"fmt"
	"net/url"
	"time"
)

// vmSnapshotRequest is the body of POST /api/{family}/{id}/snapshots.
type vmSnapshotRequest struct {
	ID     string `json:"snapshot_id,omitempty"`
	Memory bool   `json:"memory,omitempty"`
}

// snapshotView holds the fields of a Snapshot the table shows.
type snapshotView struct {
	ID        string     `json:"id"`
	VMID      string     `json:"vm_id"`
	Mode      string     `json:"mode"`
	CreatedAt *time.Time `json:"created_at"`
	Memory    bool       `json:"memory"`
	Disks     []struct {
		ID string `json:"id"`
	} `json:"disks"`
	SizeBytes int64 `json:"size_bytes"`
}

func (e *env) snapshotTable(snaps []snapshotView) {
	tw := newTable(e.stdout)
	fmt.Fprintln(tw, "ID\tVM\tMODE\tMEMORY\tDISKS\tSIZE\tAGE")
	for _, s := range snaps {
		disks := ""
		for i, d := range s.Disks {
			if i > 0 {
				disks += ","
			}
			disks += d.ID
		}
		mem := "no"
		if s.Memory {
			mem = "yes"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\n", s.ID, s.VMID, s.Mode, mem, disks, bytesSize(s.SizeBytes), age(e.now, s.CreatedAt))
	}
	tw.Flush()
}

// printSnapshots prints a snapshot (list: a {"snapshots":[…]} body) as is
// with -o json, else as a table.
func (e *env) printSnapshots(b []byte, list bool) error {
	if e.opts.output == "json" {
		e.raw(b)
		return nil
	}
	var snaps []snapshotView
	if list {
		var l struct {
			Snapshots []snapshotView `json:"snapshots"`
		}
		if err := json.Unmarshal(b, &l); err != nil {
			return fmt.Errorf("decoding the snapshot list: %w", err)
		}
		snaps = l.Snapshots
	} else {
		var s snapshotView
		if err := json.Unmarshal(b, &s); err != nil {
			return fmt.Errorf("decoding the snapshot: %w", err)
		}
		snaps = []snapshotView{s}
	}
	e.snapshotTable(snaps)
	return nil
}

// snapshotCmd runs `vmhost snapshot …` over the snapshot routes (taking
// and restoring one are `vmhost vm|appvm snapshot|restore`).
func (e *env) snapshotCmd(args []string) error {
	if len(args) == 0 {
		return usageError("snapshot: no subcommand (list, get, delete)")
	}
	sub := args[0]
	var vmID string
	pos, err := e.parse("snapshot "+sub, args[1:], func(fs *flag.FlagSet) {
		if sub == "list" {
			fs.StringVar(&vmID, "vm", "", "only this VM's snapshots")
		}
	})
	if err != nil {
		return err
	}
	want := map[string]int{"list": 0, "get": 1, "delete": 1}
	n, ok := want[sub]
	if !ok {
		return usageError("snapshot: unknown subcommand %q", sub)
	}
	if len(pos) != n {
		return usageError("snapshot %s: want %d argument(s), got %d", sub, n, len(pos))
	}
	if err := e.connect(); err != nil {
		return err
	}
	switch sub {
	case "list":
		path := "/api/snapshots"
		if vmID != "" {
			path += "?vm_id=" + url.QueryEscape(vmID)
		}
		_, b, err := e.client.do(e.ctx, "GET", path, nil)
		if err != nil {
			return err
		}
		return e.printSnapshots(b, true)
	case "get":
		_, b, err := e.client.do(e.ctx, "GET", "/api/snapshots/"+url.PathEscape(pos[0]), nil)
		if err != nil {
			return err
		}
		return e.printSnapshots(b, false)
	}
	if _, _, err := e.client.do(e.ctx, "DELETE", "/api/snapshots/"+url.PathEscape(pos[0]), nil); err != nil {
		return err
	}
	e.done(pos[0] + ": deleted")
	return nil
}

// setField sets key to value in the JSON object body.
func setField(body []byte, key, value string) ([]byte, error) {
	var m map[string]json.RawMessage
	if err := json.Unmarshal(body, &m); err != nil {
		return nil, fmt.Errorf("not a JSON object: %w", err)
	}
	if m == nil {
		m = map[string]json.RawMessage{}
	}
	v, _ := json.Marshal(value)
	m[key] = v
	return json.Marshal(m)
}
