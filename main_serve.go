package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"strings"

	"vmhost/sdnotify"
	apiserver "vmhost/server"
	"vmhost/vm"
)

// The state directory of `serve --dev`, which key and image commands use
// with --dev.
const devStateDir = apiserver.DevStateDir

// serveEnv is what newService (main_wire.go) builds the service from.
type serveEnv = apiserver.Env

// runService is newService as package server runs it; it ends the start
// profile (main_profile.go) once the service is built.
func runService(env apiserver.Env) (*apiserver.Service, error) {
	s, err := newService(env)
	stopStartProfile()
	if err != nil {
		return nil, err
	}
	return &apiserver.Service{Handler: s.Handler, Close: s.Close, CloseStreams: s.CloseStreams}, nil
}

// stopStartProfile ends the start profile serve began.
var stopStartProfile = func() {}

// serve parses serve's flags and runs the server (package server, imported as apiserver: the tests have a type server) with the
// service newService wires.
func serve(args []string, stdout, stderr io.Writer) int {
	stopStartProfile = startProfile(stderr)
	defer stopStartProfile()
	o := apiserver.Options{Stdout: stdout}
	fl := flag.NewFlagSet("vmhost serve", flag.ContinueOnError)
	fl.SetOutput(stderr)
	fl.StringVar(&o.Listen, "listen", "", `address to serve on: "host:port", or "unix:/path" for a unix socket (dev default `+apiserver.DevListen+`); the API is also on <run-dir>/`+apiserver.LocalSocket)
	fl.StringVar(&o.StateDir, "state-dir", "", "directory of VM records, disks, images, keys.json and agent_id")
	fl.StringVar(&o.RunDir, "run-dir", "", "directory of runtime sockets and logs (e.g. /run/vmhost)")
	fl.StringVar(&o.ConfigPath, "config", "", "host configuration file (JSON); none = built-in defaults")
	fl.BoolVar(&o.Dev, "dev", false, "development mode: state, run dir and config under ./"+apiserver.DevDir+"/, simulators for ch and qsd, (as root) the default network's bridge, and the shell lines (VMHOST_API; VMHOST_TOKEN with a readwrite key made on the first start) printed once serving")
	fl.StringVar(&o.TLS.Cert, "tls-cert", "", "PEM certificate (chain) to serve HTTPS with; overrides the config's tls.cert; reloaded on SIGHUP")
	fl.StringVar(&o.TLS.Key, "tls-key", "", "PEM private key of --tls-cert; overrides tls.key")
	fl.StringVar(&o.TLS.ClientCA, "tls-client-ca", "", "PEM CA certificate(s): require a client certificate signed by one of them (mutual TLS, on top of the bearer key); overrides tls.client_ca")
	fl.StringVar(&o.Simulate, "simulate", "", `run simulators instead of real programs: "ch", "qsd" or "ch,qsd" (--dev default "ch,qsd"; "none" for the real ones)`)
	fl.StringVar(&o.Simulator, "simulator", "", "the vmhost executable that runs the simulators (default: this one)")
	simCHArgs := fl.String("sim-ch-args", "", `more arguments for the Cloud Hypervisor simulator, space-separated (e.g. "--sim-backend qemu")`)
	if err := fl.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if fl.NArg() > 0 {
		fmt.Fprintf(stderr, "vmhost serve: unexpected argument %q\n", fl.Arg(0))
		return 2
	}
	o.SimCHArgs = strings.Fields(*simCHArgs)
	if !o.Dev {
		for _, req := range []struct{ name, val string }{{"--listen", o.Listen}, {"--state-dir", o.StateDir}, {"--run-dir", o.RunDir}} {
			if req.val == "" {
				fmt.Fprintf(stderr, "vmhost serve: %s is required (or use --dev)\n", req.name)
				return 2
			}
		}
	}
	o.Log = slog.New(slog.NewTextHandler(stderr, nil))
	n, err := sdnotify.FromEnv()
	if err != nil {
		o.Log.Warn("not notifying systemd", "err", err)
	}
	o.Notifier = n
	o.CheckRunDir = func(dir string) error { return vm.Layout{RunDir: dir}.CheckRunDir() }
	// The host checks of vmhost doctor, logged once at start (the server
	// adds the configuration and the state directory).
	o.Doctor = doctorHost()
	if err := apiserver.Run(o, runService); err != nil {
		o.Log.Error("serve", "err", err)
		return 1
	}
	return 0
}
