//go:build linux

package e2e

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"vmhost/internal/netnstest"
)

// BenchmarkLogFollowLatency measures how long a line takes from an
// AppVM's workload to a client of the API (simulators: the workload runs
// as a process on the host, under the real guest agent): the workload
// prints what each TCP connection to its port 7000 sends, and the time
// runs from the send to the line's arrival. Side by side, alternating:
// "follow" (GET …/logs?follow=true, the line pushed as the agent stores
// it) and "poll100ms" (GET …/logs?since_seq= every 100 ms, what a client
// without follow does). Medians are reported as median-ns/op metrics.
// The real guest's figure is in the real-guest lane's log (appvm-logs).
func BenchmarkLogFollowLatency(b *testing.B) {
	s := startAppVMServer(b, map[string]string{"echo": `while :; do /bin/busybox nc -l -p 7000; done`})
	// The simulated guest has a network namespace of its own behind the
	// bridge, as a real one has: the host side gets the gateway's address.
	if err := netnstest.RunIn(s.nsFD, exec.Command("ip", "addr", "add", "10.80.0.1/24", "dev", s.bridge).Run); err != nil {
		b.Fatal(err)
	}
	if st, body := s.do("POST", "/api/appvm/vms", `{"vm_id":"echo","image_id":"echo","vcpus":1,"memory_mb":128,"disk_gib":1,`+
		`"ip":"10.80.0.30","prefix":24,"gateway":"10.80.0.1"}`); st != http.StatusCreated {
		b.Fatalf("create = %d %s", st, body)
	}
	dial := func() (net.Conn, error) {
		var c net.Conn
		err := netnstest.RunIn(s.nsFD, func() error {
			var err error
			c, err = net.DialTimeout("tcp", "10.80.0.30:7000", 5*time.Second)
			return err
		})
		return c, err
	}
	send := func(probe string) time.Time {
		deadline := time.Now().Add(30 * time.Second)
		for {
			c, err := dial()
			if err == nil {
				sent := time.Now()
				c.Write([]byte(probe + "\n"))
				c.Close()
				return sent
			}
			if time.Now().After(deadline) {
				b.Fatalf("dialling the workload: %v", err)
			}
			time.Sleep(5 * time.Millisecond) // nc between two connections
		}
	}
	// The follower.
	req, _ := http.NewRequestWithContext(context.Background(), "GET", "http://vmhost/api/appvm/vms/echo/logs?follow=true&tail=0", nil)
	req.Header.Set("Authorization", "Bearer "+s.token)
	resp, err := (&http.Client{Transport: s.hc.Transport}).Do(req)
	if err != nil || resp.StatusCode != http.StatusOK {
		b.Fatalf("follow: %v %v", resp, err)
	}
	defer resp.Body.Close()
	arrived := make(chan string, 64)
	go func() {
		rd := bufio.NewReader(resp.Body)
		for {
			line, err := rd.ReadBytes('\n')
			if err != nil {
				close(arrived)
				return
			}
			var c logChunk
			if json.Unmarshal(line, &c) == nil {
				for _, f := range strings.Fields(c.Data) {
					arrived <- f
				}
			}
		}
	}()
	awaitFollow := func(probe string) {
		for got := range arrived {
			if got == probe {
				return
			}
		}
		b.Fatal("the follow ended")
	}
	// The poller: the last seq it has seen.
	var last uint64
	if chunks := s.logs("echo", "tail=1"); len(chunks) > 0 {
		last = chunks[0].Seq
	}
	awaitPoll := func(probe string) {
		for {
			for _, c := range s.logs("echo", "since_seq="+strconv.FormatUint(last, 10)) {
				last = c.Seq
				if strings.Contains(c.Data, probe) {
					return
				}
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	// Warm up: the workload is up once a probe comes back.
	send("probe-warm")
	awaitFollow("probe-warm")
	var follow, poll []time.Duration
	b.ResetTimer()
	for i := range b.N {
		p := fmt.Sprintf("probe-f%d", i)
		sent := send(p)
		awaitFollow(p)
		follow = append(follow, time.Since(sent))
		p = fmt.Sprintf("probe-p%d", i)
		sent = send(p)
		awaitPoll(p)
		poll = append(poll, time.Since(sent))
	}
	b.StopTimer()
	slices.Sort(follow)
	slices.Sort(poll)
	b.ReportMetric(float64(follow[len(follow)/2].Nanoseconds()), "follow-median-ns/op")
	b.ReportMetric(float64(poll[len(poll)/2].Nanoseconds()), "poll100ms-median-ns/op")
	b.Logf("log follow latency, sim: follow median %v (min %v, max %v); poll every 100 ms median %v; %d probes each",
		follow[len(follow)/2], follow[0], follow[len(follow)-1], poll[len(poll)/2], len(follow))
}
