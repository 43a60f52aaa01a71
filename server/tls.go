package server

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"sync/atomic"
	"time"
)

// TLSFiles are the PEM files the server's HTTPS uses: --tls-cert,
// --tls-key and --tls-client-ca, each over its config key (tls.cert,
// tls.key, tls.client_ca). All empty means plain HTTP.
type TLSFiles struct {
	Cert, Key, ClientCA string
}

// enabled reports whether the files ask for TLS.
func (f TLSFiles) enabled() bool { return f.Cert != "" || f.Key != "" || f.ClientCA != "" }

func (f TLSFiles) check() error {
	if (f.Cert == "") != (f.Key == "") {
		return errors.New("TLS: the certificate and the key go together (--tls-cert and --tls-key, or tls.cert and tls.key)")
	}
	if f.ClientCA != "" && f.Cert == "" {
		return errors.New("TLS: a client CA (mutual TLS) needs a certificate and a key too")
	}
	return nil
}

// nextProtos offers HTTP/1.1 only: the server's limits (connections at
// once and per source, a header and a body deadline per request, closing
// a connection after a request without a key) are per connection and per
// request of HTTP/1.1; HTTP/2 would multiplex many requests over one
// connection past them.
var nextProtos = []string{"http/1.1"}

// tlsReloader serves the TLS configuration built from TLSFiles, and builds
// it again on Reload: a handshake uses the configuration current when it
// starts, so a renewed certificate (or a new client CA) takes effect
// without dropping the connections that are open.
type tlsReloader struct {
	files    TLSFiles
	cur      atomic.Pointer[tls.Config]
	notAfter atomic.Pointer[time.Time] // the current certificate's expiry
}

// newTLSReloader loads the files; an error names the file that could not
// be used.
func newTLSReloader(files TLSFiles) (*tlsReloader, error) {
	if err := files.check(); err != nil {
		return nil, err
	}
	r := &tlsReloader{files: files}
	if err := r.Reload(); err != nil {
		return nil, err
	}
	return r, nil
}

// Reload reads the files again. On any error the previous configuration
// stays in use.
func (r *tlsReloader) Reload() error {
	cert, err := tls.LoadX509KeyPair(r.files.Cert, r.files.Key)
	if err != nil {
		return fmt.Errorf("loading the TLS certificate %s and key %s: %w", r.files.Cert, r.files.Key, err)
	}
	c := &tls.Config{
		MinVersion:   tls.VersionTLS12,
		Certificates: []tls.Certificate{cert},
		NextProtos:   nextProtos,
	}
	if r.files.ClientCA != "" {
		pem, err := os.ReadFile(r.files.ClientCA)
		if err != nil {
			return fmt.Errorf("loading the TLS client CA: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return fmt.Errorf("loading the TLS client CA %s: no PEM certificate in it", r.files.ClientCA)
		}
		// A client without a certificate signed by the CA fails the
		// handshake: it never reaches the bearer check.
		c.ClientCAs = pool
		c.ClientAuth = tls.RequireAndVerifyClientCert
	}
	r.cur.Store(c)
	if cert.Leaf != nil {
		r.notAfter.Store(&cert.Leaf.NotAfter)
	}
	return nil
}

// NotAfter is when the certificate in use expires (zero if unknown).
func (r *tlsReloader) NotAfter() time.Time {
	if t := r.notAfter.Load(); t != nil {
		return *t
	}
	return time.Time{}
}

// Config is the server's tls.Config: each handshake takes the current
// configuration.
func (r *tlsReloader) Config() *tls.Config {
	return &tls.Config{
		MinVersion: tls.VersionTLS12,
		NextProtos: nextProtos,
		GetConfigForClient: func(*tls.ClientHelloInfo) (*tls.Config, error) {
			return r.cur.Load(), nil
		},
	}
}
