package main

import (
	"bufio"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// testCA is a certificate authority made for one test.
type testCA struct {
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
	pem  []byte
}

var serial int64

func newSerial() *big.Int { serial++; return big.NewInt(time.Now().UnixNano() + serial) }

func newCA(t *testing.T, name string) *testCA {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          newSerial(),
		Subject:               pkix.Name{CommonName: name},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return &testCA{cert: cert, key: key, pem: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})}
}

// issue makes a leaf certificate: a server's for 127.0.0.1 and localhost,
// or a client's. notAfter in the past makes an expired one.
func (ca *testCA) issue(t *testing.T, cn string, client bool, notAfter time.Time) (certPEM, keyPEM []byte) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: newSerial(),
		Subject:      pkix.Name{CommonName: cn},
		NotBefore:    time.Now().Add(-48 * time.Hour),
		NotAfter:     notAfter,
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		IPAddresses:  []net.IP{net.ParseIP("127.0.0.1")},
		DNSNames:     []string{"localhost"},
	}
	if client {
		tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}
		tmpl.IPAddresses, tmpl.DNSNames = nil, nil
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		t.Fatal(err)
	}
	kder, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder})
}

// issueTo issues a certificate and writes it and its key as name.crt and
// name.key in dir.
func (ca *testCA) issueTo(t *testing.T, dir, name, cn string, client bool, notAfter time.Time) (certPath, keyPath string) {
	t.Helper()
	c, k := ca.issue(t, cn, client, notAfter)
	certPath, keyPath = filepath.Join(dir, name+".crt"), filepath.Join(dir, name+".key")
	if err := os.WriteFile(certPath, c, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(keyPath, k, 0o600); err != nil {
		t.Fatal(err)
	}
	return certPath, keyPath
}

// devToken is the key a first `serve --dev` printed, as the value of
// "export VMHOST_TOKEN=" among the lines for a shell it prints once
// serving (after recovery, so it is waited for).
func devToken(t *testing.T, s *server) string {
	t.Helper()
	return devExport(t, s, "VMHOST_TOKEN")
}

// devExport waits for the shell lines `serve --dev` prints once serving
// and returns the value of "export NAME=" ("" when it printed no such
// line).
func devExport(t *testing.T, s *server, name string) string {
	t.Helper()
	waitFor(t, func() bool { return strings.Contains(s.stdout.String(), "export VMHOST_API=") }, "serve --dev's shell lines")
	sc := bufio.NewScanner(strings.NewReader(s.stdout.String()))
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "export "+name+"="); ok {
			if name == "VMHOST_TOKEN" && !tokenLine.MatchString(v+"\n") {
				t.Fatalf("serve --dev printed the token %q, not a key", v)
			}
			return v
		}
	}
	if name == "VMHOST_TOKEN" {
		t.Fatalf("serve --dev printed no key; stdout:\n%s", s.stdout)
	}
	return ""
}

// TestServeMutualTLS runs serve with a certificate and a client CA and
// makes real handshakes: without a client certificate, with an expired one
// and with one of another CA the handshake fails; with a good one the
// bearer key still decides. SIGHUP loads a renewed server certificate; a
// broken one keeps the previous.
func TestServeMutualTLS(t *testing.T) {
	cwd := t.TempDir()
	pki := t.TempDir()
	serverCA, clientCA, otherCA := newCA(t, "server CA"), newCA(t, "client CA"), newCA(t, "other CA")
	day := time.Now().Add(90 * 24 * time.Hour) // far from the expiry warning
	srvCert, srvKey := serverCA.issueTo(t, pki, "server", "vmhost-1", false, day)
	caPath := filepath.Join(pki, "clients.pem")
	os.WriteFile(caPath, clientCA.pem, 0o600)

	s := startServer(t, cwd, "--dev", "--listen", "127.0.0.1:0", "--tls-cert", srvCert, "--tls-key", srvKey, "--tls-client-ca", caPath)
	if !strings.Contains(s.stderr.String(), "scheme=https mutual_tls=true") {
		t.Errorf("serving line does not say https with mutual TLS:\n%s", s.stderr)
	}
	token := devToken(t, s)
	if !strings.Contains(s.stderr.String(), "msg=\"TLS certificate\" not_after=") {
		t.Errorf("start did not log the certificate's expiry:\n%s", s.stderr)
	}

	roots := x509.NewCertPool()
	roots.AddCert(serverCA.cert)
	good, _ := tls.X509KeyPair(clientCA.issue(t, "ops", true, day))
	expired, _ := tls.X509KeyPair(clientCA.issue(t, "old", true, time.Now().Add(-time.Hour)))
	foreign, _ := tls.X509KeyPair(otherCA.issue(t, "stranger", true, day))

	get := func(certs []tls.Certificate, authz string) (*http.Response, error) {
		tr := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots, Certificates: certs}}
		defer tr.CloseIdleConnections()
		req, _ := http.NewRequest("GET", "https://"+s.addr+"/api/vms/x", nil)
		if authz != "" {
			req.Header.Set("Authorization", authz)
		}
		resp, err := (&http.Client{Transport: tr, Timeout: 10 * time.Second}).Do(req)
		if err == nil {
			resp.Body.Close()
		}
		return resp, err
	}
	for _, tt := range []struct {
		name  string
		certs []tls.Certificate
	}{
		{"no client certificate", nil},
		{"expired client certificate", []tls.Certificate{expired}},
		{"client certificate of another CA", []tls.Certificate{foreign}},
	} {
		if resp, err := get(tt.certs, "Bearer "+token); err == nil {
			t.Errorf("%s: answered %d, want a failed handshake", tt.name, resp.StatusCode)
		}
	}
	if resp, err := get([]tls.Certificate{good}, ""); err != nil || resp.StatusCode != http.StatusUnauthorized {
		t.Errorf("good client certificate, no bearer key = %v, %v; want 401", resp, err)
	}
	if resp, err := get([]tls.Certificate{good}, "Bearer "+token); err != nil || resp.StatusCode != http.StatusNotFound {
		t.Errorf("good client certificate and key = %v, %v; want 404", resp, err)
	}
	// Plain HTTP is not served.
	if resp, err := http.Get("http://" + s.addr + "/api/vms/x"); err == nil {
		resp.Body.Close()
		if resp.StatusCode != http.StatusBadRequest {
			t.Errorf("plain HTTP to the TLS port = %d", resp.StatusCode)
		}
	}
	// TLS 1.1 is refused.
	if c, err := tls.Dial("tcp", s.addr, &tls.Config{RootCAs: roots, Certificates: []tls.Certificate{good}, MaxVersion: tls.VersionTLS11}); err == nil {
		c.Close()
		t.Error("a TLS 1.1 handshake succeeded")
	}

	serverCN := func() string {
		c, err := tls.Dial("tcp", s.addr, &tls.Config{RootCAs: roots, Certificates: []tls.Certificate{good}, NextProtos: []string{"h2", "http/1.1"}})
		if err != nil {
			t.Fatalf("handshake: %v", err)
		}
		defer c.Close()
		if p := c.ConnectionState().NegotiatedProtocol; p != "http/1.1" {
			t.Errorf("negotiated protocol %q, want http/1.1 (the connection limits are HTTP/1.1's)", p)
		}
		return c.ConnectionState().PeerCertificates[0].Subject.CommonName
	}
	if cn := serverCN(); cn != "vmhost-1" {
		t.Fatalf("server certificate CN = %q, want vmhost-1", cn)
	}

	// A renewed certificate, loaded on SIGHUP.
	serverCA.issueTo(t, pki, "server", "vmhost-2", false, day)
	if err := s.cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() bool { return strings.Contains(s.stderr.String(), "reloaded the TLS certificate") }, "the TLS reload")
	if cn := serverCN(); cn != "vmhost-2" {
		t.Errorf("server certificate CN after SIGHUP = %q, want vmhost-2", cn)
	}
	// A broken one is refused and the previous one kept.
	os.WriteFile(srvCert, []byte("not a certificate\n"), 0o600)
	s.cmd.Process.Signal(syscall.SIGHUP)
	waitFor(t, func() bool {
		return strings.Contains(s.stderr.String(), "reloading the TLS certificate; keeping the previous one")
	}, "the failed TLS reload")
	if cn := serverCN(); cn != "vmhost-2" {
		t.Errorf("server certificate CN after a failed reload = %q, want vmhost-2", cn)
	}

	// A new client CA, loaded on SIGHUP with a good certificate again:
	// the old CA's clients are refused from then on, the new one's served.
	// This one expires within a week: the reload warns.
	serverCA.issueTo(t, pki, "server", "vmhost-3", false, time.Now().Add(7*24*time.Hour))
	newCA := newCA(t, "new client CA")
	os.WriteFile(caPath, newCA.pem, 0o600)
	s.cmd.Process.Signal(syscall.SIGHUP)
	waitFor(t, func() bool { return strings.Count(s.stderr.String(), "reloaded the TLS certificate") == 2 }, "the second TLS reload")
	if resp, err := get([]tls.Certificate{good}, "Bearer "+token); err == nil {
		t.Errorf("old CA's client after the CA changed: answered %d, want a failed handshake", resp.StatusCode)
	}
	if !strings.Contains(s.stderr.String(), "the TLS certificate expires soon") {
		t.Errorf("reloading a certificate that expires in a week did not warn:\n%s", s.stderr)
	}
	renewed, _ := tls.X509KeyPair(newCA.issue(t, "ops", true, day))
	if resp, err := get([]tls.Certificate{renewed}, "Bearer "+token); err != nil || resp.StatusCode != http.StatusNotFound {
		t.Errorf("new CA's client = %v, %v; want 404", resp, err)
	}
	if code := s.stop(t, syscall.SIGTERM); code != 0 {
		t.Errorf("exit code = %d", code)
	}
}

// TestServeTLSRefusals: a certificate without its key, a unix socket with
// TLS and an unreadable certificate stop serve before it serves.
func TestServeTLSRefusals(t *testing.T) {
	cwd := t.TempDir()
	ca := newCA(t, "ca")
	cert, key := ca.issueTo(t, cwd, "s", "s", false, time.Now().Add(time.Hour))
	for _, tt := range []struct {
		args []string
		want string
	}{
		{[]string{"--tls-cert", cert}, "certificate and the key go together"},
		{[]string{"--tls-client-ca", cert}, "needs a certificate and a key too"},
		{[]string{"--tls-cert", cert, "--tls-key", key, "--listen", "unix:" + filepath.Join(cwd, "s.sock")}, "TLS applies to a TCP address"},
		{[]string{"--tls-cert", filepath.Join(cwd, "absent.crt"), "--tls-key", key}, "loading the TLS certificate"},
	} {
		args := append([]string{"serve", "--dev", "--listen", "127.0.0.1:0"}, tt.args...)
		_, errOut, code := vmhost(t, cwd, args...)
		if code != 1 || !strings.Contains(errOut, tt.want) {
			t.Errorf("vmhost %q = %d, %s; want 1 and %q", args, code, errOut, tt.want)
		}
	}
}

// TestCLIMutualTLS: the client reaches an HTTPS agent with --cacert and a
// client certificate, and fails cleanly without one.
func TestCLIMutualTLS(t *testing.T) {
	cwd := t.TempDir()
	pki := t.TempDir()
	serverCA, clientCA := newCA(t, "server CA"), newCA(t, "client CA")
	day := time.Now().Add(90 * 24 * time.Hour) // far from the expiry warning
	srvCert, srvKey := serverCA.issueTo(t, pki, "server", "vmhost-1", false, day)
	caPath := filepath.Join(pki, "clients.pem")
	os.WriteFile(caPath, clientCA.pem, 0o600)
	serverCAPath := filepath.Join(pki, "server-ca.pem")
	os.WriteFile(serverCAPath, serverCA.pem, 0o600)
	cliCert, cliKey := clientCA.issueTo(t, pki, "ops", "ops", true, day)

	s := startServer(t, cwd, "--dev", "--listen", "127.0.0.1:0", "--tls-cert", srvCert, "--tls-key", srvKey, "--tls-client-ca", caPath)
	env := []string{"VMHOST_API=https://" + s.addr, "VMHOST_TOKEN=" + devToken(t, s)}
	out, errOut, code := vmhostEnv(t, cwd, env, "vm", "list", "--cacert", serverCAPath, "--cert", cliCert, "--key", cliKey)
	if code != 0 || !strings.HasPrefix(out, "ID ") {
		t.Errorf("vm list over mutual TLS = %d, %q, %q", code, out, errOut)
	}
	_, errOut, code = vmhostEnv(t, cwd, env, "vm", "list", "--cacert", serverCAPath)
	if code != 1 || !strings.Contains(errOut, "GET /api/vms at https://") {
		t.Errorf("vm list without a client certificate = %d, %q; want 1 and the failed handshake", code, errOut)
	}
	_, errOut, code = vmhostEnv(t, cwd, env, "vm", "list", "--cert", cliCert, "--key", cliKey)
	if code != 1 || !strings.Contains(errOut, "certificate") {
		t.Errorf("vm list without the agent's CA = %d, %q; want 1 and an unknown authority", code, errOut)
	}
	s.stop(t, syscall.SIGTERM)
}
