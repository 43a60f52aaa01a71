package qmp

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestGetFD: the file GetFD hands over reaches the monitor as SCM_RIGHTS
// with the getfd command's bytes (the server reads the very file through
// the descriptor it received), and a connection that is not a unix socket
// is refused before anything is sent.
func TestGetFD(t *testing.T) {
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	conn := func(fd int) *net.UnixConn {
		f := os.NewFile(uintptr(fd), "socket")
		defer f.Close()
		c, err := net.FileConn(f)
		if err != nil {
			t.Fatal(err)
		}
		return c.(*net.UnixConn)
	}
	cli, srv := conn(fds[0]), conn(fds[1])
	defer srv.Close()
	path := filepath.Join(t.TempDir(), "stream")
	if err := os.WriteFile(path, []byte("the file's bytes"), 0o600); err != nil {
		t.Fatal(err)
	}
	got := make(chan string, 1)
	go func() {
		srv.Write([]byte(greetingLine))
		var pending bytes.Buffer
		for {
			buf, oob := make([]byte, 4096), make([]byte, 128)
			n, oobn, _, _, err := srv.ReadMsgUnix(buf, oob)
			if err != nil {
				got <- "read: " + err.Error()
				return
			}
			var passed string
			if msgs, _ := syscall.ParseSocketControlMessage(oob[:oobn]); len(msgs) == 1 {
				if rights, err := syscall.ParseUnixRights(&msgs[0]); err == nil && len(rights) == 1 {
					b := make([]byte, 64)
					k, _ := syscall.Pread(rights[0], b, 0)
					passed = string(b[:k])
					syscall.Close(rights[0])
				}
			}
			pending.Write(buf[:n])
			line, err := pending.ReadBytes('\n')
			if err != nil {
				continue
			}
			var m map[string]any
			json.Unmarshal(line, &m)
			srv.Write([]byte(fmt.Sprintf(`{"return": {}, "id": %q}`+"\r\n", m["id"])))
			if m["execute"] == "getfd" {
				args, _ := m["arguments"].(map[string]any)
				got <- fmt.Sprintf("%v %q", args["fdname"], passed)
				return
			}
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, err := New(ctx, cli)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := c.GetFD(ctx, "snap", f); err != nil {
		t.Fatal(err)
	}
	if g := <-got; g != `snap "the file's bytes"` {
		t.Errorf("the monitor got %s, want getfd of snap with the file", g)
	}

	p := scriptedServer(t, func(next func() map[string]any, send func(string)) {
		if m := next(); m != nil {
			t.Errorf("a command reached a pipe monitor: %v", m)
		}
	})
	if err := p.GetFD(ctx, "snap", f); err == nil || !strings.Contains(err.Error(), "unix socket") {
		t.Errorf("GetFD over a pipe = %v, want refused: not a unix socket", err)
	}
}
