package guest

import (
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/mdlayher/vsock"

	"vmhost/appvm/guest/proto"
)

// opsContext is what operations beside the workload need: the Spec (the
// secret files' paths, the working directory), the workload's environment
// and its user.
type opsContext struct {
	spec *proto.Spec
	env  []string
	acc  account
}

// requestWait bounds the wait for an operation's request frame.
const requestWait = 10 * time.Second

// stallTimeout is how long a frame may wait for a host that does not read
// before the host counts as gone.
const stallTimeout = 2 * time.Minute

// listenOps listens where opts.listen says: AF_VSOCK port proto.OpPort in a
// VM, or the unix socket <prefix>_<OpPort> in process mode (the simulator
// routes the host's CONNECT there). It returns nil, nil without --listen.
func (a *agent) listenOps() (net.Listener, error) {
	switch l := a.opts.listen; {
	case l == "":
		return nil, nil
	case l == "vsock":
		return vsock.Listen(proto.OpPort, nil)
	case strings.HasPrefix(l, "unix:"):
		p := strings.TrimPrefix(l, "unix:") + "_" + strconv.Itoa(proto.OpPort)
		// A socket left by an agent killed before (an earlier boot).
		if fi, err := os.Lstat(p); err == nil && fi.Mode().Type() == fs.ModeSocket {
			os.Remove(p)
		}
		return net.Listen("unix", p)
	}
	return nil, fmt.Errorf("unknown --listen %q", a.opts.listen)
}

// serveOps serves operation connections until l is closed.
func (a *agent) serveOps(l net.Listener) {
	for {
		c, err := l.Accept()
		if err != nil {
			if !errors.Is(err, net.ErrClosed) {
				a.log.Error("accepting operation connections", "err", err)
			}
			return
		}
		go a.serveOp(c)
	}
}

// opFail builds the OpError a handler returns.
func opFail(code, format string, args ...any) *proto.OpError {
	return &proto.OpError{Code: code, Message: fmt.Sprintf(format, args...)}
}

// serveOp runs one operation: the request, then the operation's frames. A
// handler's error becomes the last frame (FrameError).
func (a *agent) serveOp(c net.Conn) {
	defer c.Close()
	fc := proto.NewFrameConn(c)
	c.SetReadDeadline(time.Now().Add(requestWait))
	t, p, err := fc.ReadFrame()
	if err != nil {
		a.log.Warn("operation connection without a request", "err", err)
		return
	}
	c.SetReadDeadline(time.Time{})
	err = a.dispatch(c, fc, t, p)
	if err == nil {
		return
	}
	var oe *proto.OpError
	if !errors.As(err, &oe) {
		oe = opFail(proto.ErrInternal, "%v", err)
	}
	a.log.Warn("operation failed", "code", oe.Code, "err", oe.Message)
	c.SetWriteDeadline(time.Now().Add(stallTimeout))
	fc.WriteJSON(proto.FrameError, oe)
}

func (a *agent) dispatch(c net.Conn, fc *proto.FrameConn, t proto.FrameType, p []byte) error {
	if t != proto.FrameRequest {
		return opFail(proto.ErrBadRequest, "the first frame is of type %d, not a request", t)
	}
	req, err := proto.DecodeRequest(p)
	if err != nil {
		return opFail(proto.ErrBadRequest, "%v", err)
	}
	if req.Signal != nil {
		return a.opSignal(c, fc, req.Signal.Signal)
	}
	a.opsMu.Lock()
	oc := a.ops
	a.opsMu.Unlock()
	if oc == nil {
		return opFail(proto.ErrInvalidState, "the guest is not set up: the workload's root is not ready")
	}
	switch {
	case req.Exec != nil:
		return a.opExec(c, fc, oc, req.Exec)
	case req.GetFiles != nil:
		return a.opGetFiles(c, fc, oc, req.GetFiles.Path)
	default:
		return a.opPutFiles(c, fc, oc, req.PutFiles)
	}
}

// opSignal delivers sig to the workload process (not its group, as the
// forwarded signals and docker kill do).
func (a *agent) opSignal(c net.Conn, fc *proto.FrameConn, sig int) error {
	pid := int(a.workloadPID.Load())
	if pid == 0 {
		return opFail(proto.ErrInvalidState, "no workload runs (it has not started)")
	}
	if err := a.reaper.signal(pid, syscall.Signal(sig)); errors.Is(err, os.ErrProcessDone) {
		return opFail(proto.ErrInvalidState, "no workload runs (it has exited)")
	} else if err != nil {
		return fmt.Errorf("signalling the workload: %w", err)
	}
	a.log.Info("signal delivered to the workload", "signal", sig, "pid", pid)
	c.SetWriteDeadline(time.Now().Add(stallTimeout))
	return fc.WriteFrame(proto.FrameDone, []byte("{}"))
}
