// Package cli is vmhost's command-line client for operators: one command
// per API route (the VMs of both families, volumes, AppVM images, registry
// images, the image cache, networks, host PCI devices, events, metrics,
// health) and `vmhost console`. Synopses lists them; each names the routes
// it calls, and the same list makes `vmhost help`, the manual page and the
// completion scripts (Completion). The client talks to an agent's API over
// HTTP only (never importing the agent's packages), so it works the same
// against a local or a remote agent.
//
// # Connecting
//
// --api (or $VMHOST_API) is http://HOST:PORT, https://HOST:PORT or
// unix:/path (plain HTTP over a unix socket); the default is
// unix:/run/vmhost/api.sock, where the packaged service listens. --token
// (or $VMHOST_TOKEN, or --token-file) is the bearer key; it is never
// printed. For HTTPS, --cacert names the CA bundle that signed the agent's
// certificate (default: the system roots) and --cert/--key a client
// certificate for mutual TLS.
//
// # Output and exit status
//
// Lists and single reads print aligned tables; -o json prints the API's
// body unchanged. The client flags (GlobalFlags) may come before the
// command or after its arguments. An API error prints "CODE: message" on
// stderr and exits 1; a usage error exits 2. With neither --api nor
// $VMHOST_API, an absent packaged socket says how to reach a dev agent.
package cli

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/http"
	"net/url"
	"os"
	"slices"
	"strings"
	"time"
)

// DefaultAPI is where the packaged service listens (dist/vmhost.service).
const DefaultAPI = "unix:/run/vmhost/api.sock"

// DefaultRunDir is the packaged service's run directory, where `vmhost
// console` finds the VMs' console sockets.
const DefaultRunDir = "/run/vmhost"

// Commands are the first words Run handles.
var Commands = func() []string {
	var out []string
	for _, s := range Synopses {
		if c, _ := s.Command(); !slices.Contains(out, c) {
			out = append(out, c)
		}
	}
	return out
}()

// errUsage marks an error that exits 2.
var errUsage = errors.New("usage")

// usageError is a usage error with its message.
func usageError(format string, a ...any) error {
	return fmt.Errorf("%w: "+format, append([]any{errUsage}, a...)...)
}

// APIError is an error answer of the API: its code and message (from
// {"code","message"}, also accepted nested as {"error":{...}}), or the
// status and the plain text (422) when the body is not the JSON shape.
type APIError struct {
	Status  int
	Code    string
	Message string
}

func (e *APIError) Error() string {
	if e.Code == "" {
		return fmt.Sprintf("HTTP %d: %s", e.Status, e.Message)
	}
	return e.Code + ": " + e.Message
}

func parseAPIError(status int, body []byte) *APIError {
	var flat struct {
		Code    string `json:"code"`
		Message string `json:"message"`
		Error   *struct {
			Code    string `json:"code"`
			Message string `json:"message"`
		} `json:"error"`
	}
	if json.Unmarshal(body, &flat) == nil {
		if flat.Error != nil && flat.Error.Code != "" {
			return &APIError{Status: status, Code: flat.Error.Code, Message: flat.Error.Message}
		}
		if flat.Code != "" {
			return &APIError{Status: status, Code: flat.Code, Message: flat.Message}
		}
	}
	msg := strings.TrimSpace(string(body))
	if msg == "" {
		msg = http.StatusText(status)
	}
	return &APIError{Status: status, Message: msg}
}

// options are the flags every client command takes.
type options struct {
	api, token, tokenFile string
	cacert, cert, key     string
	output                string
	runDir                string
}

// register adds the flags to fs, each defaulting to its value in o, so
// that flags given before the command stay unless given again after it.
func (o *options) register(fs *flag.FlagSet) {
	fs.StringVar(&o.api, "api", o.api, "API address: http://HOST:PORT, https://HOST:PORT or unix:/path (default $VMHOST_API, else "+DefaultAPI+")")
	fs.StringVar(&o.token, "token", o.token, "API key (default $VMHOST_TOKEN); prefer the variable or --token-file, as arguments show in ps")
	fs.StringVar(&o.tokenFile, "token-file", o.tokenFile, "file holding the API key")
	fs.StringVar(&o.cacert, "cacert", o.cacert, "PEM CA bundle that signed the agent's certificate (https; default: the system roots)")
	fs.StringVar(&o.cert, "cert", o.cert, "PEM client certificate for mutual TLS")
	fs.StringVar(&o.key, "key", o.key, "PEM private key of --cert")
	fs.StringVar(&o.output, "o", o.output, "output: table or json (the API's body unchanged)")
}

// Client talks to one agent's API. Base is the URL prefix requests go to.
type Client struct {
	HTTP  *http.Client
	Base  string
	api   string // as given, for errors
	token string
	// defaulted: no --api and no $VMHOST_API named the agent, so the
	// packaged service's socket was tried.
	defaulted bool
}

// newClient builds the client of o (flags, then the environment).
func newClient(o *options, getenv func(string) string) (*Client, error) {
	api := o.api
	if api == "" {
		api = getenv("VMHOST_API")
	}
	defaulted := api == ""
	if defaulted {
		api = DefaultAPI
	}
	token := o.token
	if token == "" && o.tokenFile != "" {
		b, err := os.ReadFile(o.tokenFile)
		if err != nil {
			return nil, fmt.Errorf("reading --token-file: %w", err)
		}
		token = strings.TrimSpace(string(b))
	}
	if token == "" {
		token = getenv("VMHOST_TOKEN")
	}
	tr := http.DefaultTransport.(*http.Transport).Clone()
	c := &Client{HTTP: &http.Client{Transport: tr}, api: api, token: token, defaulted: defaulted}
	if path, ok := strings.CutPrefix(api, "unix:"); ok {
		if path == "" {
			return nil, usageError("--api unix: needs a socket path")
		}
		tr.DialContext = func(ctx context.Context, _, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", path)
		}
		c.Base = "http://vmhost"
		return c, nil
	}
	u, err := url.Parse(api)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, usageError("--api %q: want http://HOST:PORT, https://HOST:PORT or unix:/path", api)
	}
	c.Base = strings.TrimSuffix(u.String(), "/")
	if u.Scheme == "https" {
		cfg := &tls.Config{MinVersion: tls.VersionTLS12}
		if o.cacert != "" {
			pem, err := os.ReadFile(o.cacert)
			if err != nil {
				return nil, fmt.Errorf("reading --cacert: %w", err)
			}
			cfg.RootCAs = x509.NewCertPool()
			if !cfg.RootCAs.AppendCertsFromPEM(pem) {
				return nil, fmt.Errorf("--cacert %s: no PEM certificate in it", o.cacert)
			}
		}
		if (o.cert == "") != (o.key == "") {
			return nil, usageError("--cert and --key go together")
		}
		if o.cert != "" {
			pair, err := tls.LoadX509KeyPair(o.cert, o.key)
			if err != nil {
				return nil, fmt.Errorf("loading the client certificate: %w", err)
			}
			cfg.Certificates = []tls.Certificate{pair}
		}
		tr.TLSClientConfig = cfg
	} else if o.cacert != "" || o.cert != "" {
		return nil, usageError("--cacert, --cert and --key need an https:// --api")
	}
	return c, nil
}

// do sends a request and returns the body of a 2xx answer; any other
// answer is an *APIError. body nil sends none.
func (c *Client) do(ctx context.Context, method, path string, body []byte) (int, []byte, error) {
	resp, err := c.send(ctx, method, path, body, nil)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return 0, nil, fmt.Errorf("reading the answer to %s %s: %w", method, path, err)
	}
	if resp.StatusCode/100 != 2 {
		return resp.StatusCode, nil, parseAPIError(resp.StatusCode, b)
	}
	return resp.StatusCode, b, nil
}

// send sends a request with a JSON body (nil: none) and returns the
// response, whatever its status.
func (c *Client) send(ctx context.Context, method, path string, body []byte, hdr http.Header) (*http.Response, error) {
	if body == nil {
		return c.sendReader(ctx, method, path, nil, "", hdr)
	}
	return c.sendReader(ctx, method, path, bytes.NewReader(body), "application/json", hdr)
}

// sendReader sends a request whose body (nil: none) of type contentType
// is read from body as it goes, and returns the response, whatever its
// status.
func (c *Client) sendReader(ctx context.Context, method, path string, body io.Reader, contentType string, hdr http.Header) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, method, c.Base+path, body)
	if err != nil {
		return nil, err
	}
	for k, v := range hdr {
		req.Header[k] = v
	}
	if body != nil {
		req.Header.Set("Content-Type", contentType)
	}
	if c.token != "" {
		req.Header.Set("Authorization", "Bearer "+c.token)
	}
	resp, err := c.HTTP.Do(req)
	if err != nil {
		// The error names the API, never the header holding the token.
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err
		}
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		if c.defaulted && errors.Is(err, fs.ErrNotExist) {
			return nil, fmt.Errorf("no agent at %s, where the packaged service listens (is it running? systemctl status vmhost).\n"+
				"For an agent started with vmhost serve --dev, run the two export lines it printed (export VMHOST_API=http://127.0.0.1:8080\n"+
				"and export VMHOST_TOKEN=vmh_...), or give --api and --token", c.api)
		}
		return nil, fmt.Errorf("%s %s at %s: %w", method, path, c.api, err)
	}
	return resp, nil
}

// env is one run of a command: its I/O, client and options.
type env struct {
	ctx    context.Context
	stdin  io.Reader
	stdout io.Writer
	stderr io.Writer
	getenv func(string) string
	now    time.Time
	opts   options
	client *Client
	cmd    string // the command run, for its usage
}

// Run runs a client command line (args[0] one of Commands) until done or
// ctx ends, and returns the exit status: 0, 1 (the API or the connection
// failed), 2 (usage), or the status of what `vmhost appvm exec` and
// `vmhost run` ran.
func Run(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer, getenv func(string) string) int {
	if getenv == nil {
		getenv = os.Getenv
	}
	e := &env{ctx: ctx, stdin: stdin, stdout: stdout, stderr: stderr, getenv: getenv, now: time.Now(), opts: options{output: "table"}}
	err := e.run(args)
	switch {
	case err == nil:
		return 0
	case errors.Is(err, flag.ErrHelp):
		return 0
	case errors.Is(err, errUsage):
		usage := Usage
		if e.cmd != "" && slices.Contains(Commands, e.cmd) {
			usage = commandUsage(e.cmd)
		}
		fmt.Fprintf(stderr, "vmhost %s\n%s", strings.TrimPrefix(err.Error(), "usage: "), usage)
		return 2
	}
	var xs *exitStatus // vmhost appvm exec, vmhost run: a status of their own
	if errors.As(err, &xs) {
		if xs.msg != "" {
			fmt.Fprintf(stderr, "vmhost %s: %s\n", e.cmd, xs.msg)
		}
		return xs.code
	}
	var ae *APIError
	if errors.As(err, &ae) {
		fmt.Fprintln(stderr, ae.Error())
		if ae.Status == http.StatusUnauthorized && e.client != nil && e.client.token == "" {
			fmt.Fprintln(stderr, "(no API key given: set VMHOST_TOKEN, or use --token-file)")
		}
		return 1
	}
	fmt.Fprintf(stderr, "vmhost: %v\n", err)
	return 1
}

func (e *env) run(args []string) error {
	// Client flags may come before the command (vmhost -o json vm list).
	lead := flag.NewFlagSet("vmhost", flag.ContinueOnError)
	lead.SetOutput(io.Discard)
	e.opts.register(lead)
	if err := lead.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			fmt.Fprint(e.stdout, Usage)
			return nil
		}
		return usageError("%v", err)
	}
	args = lead.Args()
	if len(args) == 0 {
		return usageError("no command")
	}
	cmd, rest := args[0], args[1:]
	e.cmd = cmd
	if len(rest) > 0 && cmd != "events" && cmd != "console" {
		switch rest[0] {
		case "-h", "-help", "--help", "help":
			fmt.Fprint(e.stdout, commandUsage(cmd))
			return nil
		}
	}
	switch cmd {
	case "list":
		return e.listAll(rest)
	case "vm":
		return e.vmCmd("vm", rest)
	case "appvm":
		return e.vmCmd("appvm", rest)
	case "volume":
		return e.volumeCmd(rest)
	case "snapshot":
		return e.snapshotCmd(rest)
	case "image":
		return e.imageCmd(rest)
	case "registry":
		return e.registryCmd(rest)
	case "cache":
		return e.cacheCmd(rest)
	case "network":
		return e.networkCmd(rest)
	case "host":
		return e.hostCmd(rest)
	case "events":
		return e.eventsCmd(rest)
	case "metrics", "health":
		return e.textCmd(cmd, rest)
	case "console":
		return e.consoleCmd(rest)
	case "run":
		return e.runCmd(rest)
	}
	return usageError("unknown command %q", cmd)
}

// parse parses flags anywhere among the arguments (`vm get ID -o json`)
// and returns the positional ones; everything after "--" is positional.
func (e *env) parse(name string, args []string, setup func(fs *flag.FlagSet)) ([]string, error) {
	fs := flag.NewFlagSet("vmhost "+name, flag.ContinueOnError)
	fs.SetOutput(e.stderr)
	e.opts.register(fs)
	if setup != nil {
		setup(fs)
	}
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				return nil, err
			}
			return nil, usageError("%s: %v", name, err)
		}
		if fs.NArg() == 0 {
			break
		}
		if len(args) > 0 && len(fs.Args()) < len(args) && args[len(args)-len(fs.Args())-1] == "--" {
			pos = append(pos, fs.Args()...)
			break
		}
		pos = append(pos, fs.Arg(0))
		args = fs.Args()[1:]
	}
	if e.opts.output != "table" && e.opts.output != "json" {
		return nil, usageError("%s: -o %q: want table or json", name, e.opts.output)
	}
	return pos, nil
}

// connect builds the client once the flags are parsed.
func (e *env) connect() error {
	c, err := newClient(&e.opts, e.getenv)
	if err != nil {
		return err
	}
	e.client = c
	return nil
}

// raw prints an API body unchanged (-o json), ending it with a newline.
func (e *env) raw(b []byte) {
	e.stdout.Write(b)
	if len(b) > 0 && b[len(b)-1] != '\n' {
		io.WriteString(e.stdout, "\n")
	}
}
