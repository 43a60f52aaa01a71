package chsim

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
)

// The HTTP layer is written by hand rather than with net/http so that the wire looks like
// CH's micro_http: exact header set, 204 without Content-Type or Content-Length, a 51,200
// byte body limit, no chunked bodies, and parse errors in micro_http's own shape.

const (
	maxBody        = 51200 // v53 request body limit
	maxConnections = 10    // micro_http's connection cap
	maxHeaderBytes = 8192
)

type request struct {
	method string
	path   string
	body   []byte // nil when there is no body (absent or Content-Length: 0)
}

type response struct {
	status int
	body   []byte // nil → Content-Length: 0 (except 204, which has no length header)
}

// parseError is a request micro_http could not parse; it answers 400 with
// {"error": "…\nAll previous unanswered requests will be dropped."} and closes.
type parseError struct{ msg string }

func (e *parseError) Error() string { return e.msg }

func readRequest(br *bufio.Reader) (*request, error) {
	line, err := readLine(br)
	if err != nil {
		return nil, err
	}
	parts := strings.Split(line, " ")
	if len(parts) != 3 {
		return nil, &parseError{"Invalid request."}
	}
	method, uri, version := parts[0], parts[1], parts[2]
	if version != "HTTP/1.1" && version != "HTTP/1.0" {
		return nil, &parseError{"Invalid HTTP Version: Unsupported HTTP version."}
	}
	if method == "" || strings.ToUpper(method) != method {
		return nil, &parseError{"Invalid HTTP Method: Unsupported HTTP method."}
	}
	if strings.HasPrefix(uri, "http://") {
		// Absolute form: keep only the path.
		rest := strings.TrimPrefix(uri, "http://")
		if i := strings.IndexByte(rest, '/'); i >= 0 {
			uri = rest[i:]
		} else {
			uri = "/"
		}
	}
	if !strings.HasPrefix(uri, "/") {
		return nil, &parseError{"Invalid URI: Unsupported URI."}
	}
	length := 0
	total := len(line)
	for {
		h, err := readLine(br)
		if err != nil {
			return nil, err
		}
		total += len(h)
		if total > maxHeaderBytes {
			return nil, &parseError{"Invalid request."}
		}
		if h == "" {
			break
		}
		name, value, ok := strings.Cut(h, ":")
		if !ok {
			return nil, &parseError{fmt.Sprintf("Invalid header. Reason: Header is incorrectly formatted. Key: %s", h)}
		}
		value = strings.TrimSpace(value)
		switch strings.ToLower(strings.TrimSpace(name)) {
		case "content-length":
			n, err := strconv.ParseUint(value, 10, 32)
			if err != nil {
				return nil, &parseError{fmt.Sprintf("Invalid header. Reason: Invalid value. Key:%s; Value:%s", name, value)}
			}
			length = int(n)
		case "transfer-encoding":
			if !strings.EqualFold(value, "identity") {
				// micro_http has no chunked decoder; the body cannot be framed.
				return nil, &parseError{fmt.Sprintf("Invalid header. Reason: Unsupported value. Key:%s; Value:%s", name, value)}
			}
		}
	}
	if length > maxBody {
		return nil, &parseError{fmt.Sprintf("Request payload with size %d is larger than the limit of %d allowed by server.", length, maxBody)}
	}
	req := &request{method: method, path: uri}
	if length > 0 {
		req.body = make([]byte, length)
		if _, err := io.ReadFull(br, req.body); err != nil {
			return nil, err
		}
	}
	return req, nil
}

func readLine(br *bufio.Reader) (string, error) {
	line, err := br.ReadSlice('\n')
	if errors.Is(err, bufio.ErrBufferFull) {
		return "", &parseError{"Invalid request."}
	}
	if err != nil {
		return "", err
	}
	return strings.TrimRight(string(line), "\r\n"), nil
}

func writeResponse(w *bufio.Writer, r response) error {
	fmt.Fprintf(w, "HTTP/1.1 %d %s\r\nServer: Cloud Hypervisor API\r\nConnection: keep-alive\r\n", r.status, http.StatusText(r.status))
	if r.status != http.StatusNoContent {
		fmt.Fprintf(w, "Content-Type: application/json\r\nContent-Length: %d\r\n", len(r.body))
	}
	w.WriteString("\r\n")
	if r.status != http.StatusNoContent {
		w.Write(r.body)
	}
	return w.Flush()
}

// serveConn answers requests on one connection until it closes.
func (s *sim) serveConn(c net.Conn) {
	defer c.Close()
	br := bufio.NewReaderSize(c, maxHeaderBytes)
	bw := bufio.NewWriter(c)
	for {
		req, err := readRequest(br)
		var pe *parseError
		if errors.As(err, &pe) {
			body, _ := json.Marshal(map[string]string{"error": pe.msg + "\nAll previous unanswered requests will be dropped."})
			writeResponse(bw, response{status: http.StatusBadRequest, body: body})
			return
		}
		if err != nil {
			return
		}
		resp, after := s.route(req)
		if err := writeResponse(bw, resp); err != nil {
			return
		}
		if after != nil {
			after()
		}
	}
}

// serve accepts connections, keeping at most maxConnections open.
func (s *sim) serve(l net.Listener) {
	slots := make(chan struct{}, maxConnections)
	for {
		c, err := l.Accept()
		if err != nil {
			return
		}
		select {
		case slots <- struct{}{}:
			go func() {
				defer func() { <-slots }()
				s.serveConn(c)
			}()
		default:
			// micro_http refuses connections beyond its cap.
			c.Close()
		}
	}
}

func jsonResponse(status int, v any) response {
	body, err := json.Marshal(v)
	if err != nil {
		return response{status: http.StatusInternalServerError}
	}
	return response{status: status, body: body}
}

// apiError answers with CH's error chain, "Error from API" first.
func apiError(status int, chain ...string) response {
	return jsonResponse(status, append([]string{"Error from API"}, chain...))
}
