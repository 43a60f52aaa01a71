// Package registry reads the image indexes a host is configured with and
// answers which images a classic create can name: SimpleStreams
// products:1.0 documents (what Ubuntu's cloud-images server, LXD and Incus
// image servers and MAAS publish) and flat vmhost indexes.
//
// Each index keeps its last good content when a later read fails, and a
// failure is logged once per streak. URL credentials and queries never
// reach a view or a log: Source and every message carry Redact's form.
//
// The package imports none of vmhost's packages.
package registry

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"path"
	"sort"
	"strings"
)

// Image is one image a classic create can name.
type Image struct {
	ImageID       string `json:"image_id"`
	ContentSHA256 string `json:"content_sha256"`
	FetchURL      string `json:"fetch_url"`
	Distro        string `json:"distro,omitempty"`
	Version       string `json:"version,omitempty"`
	Arch          string `json:"arch,omitempty"`
	SizeBytes     int64  `json:"size_bytes,omitempty"`
	// Source is the index the image came from, credentials removed.
	Source string `json:"source,omitempty"`
}

// diskFtypes are the SimpleStreams item types that are qcow2 disk
// images, in the order one is chosen when a version has several: the
// generic cloud image before the KVM-optimised one.
var diskFtypes = []string{"disk1.img", "disk-kvm.img", "qcow2"}

// Parse reads an index document fetched from location (a URL or an
// absolute path): a SimpleStreams products:1.0 document or a flat vmhost
// index {"images": [...]}. Entries that are not qcow2 disk images, or
// lack a digest or an http(s) location, are skipped (so a products
// document read from a file lists nothing: its paths are relative to a
// mirror URL it does not name); a document that is neither format is an
// error.
func Parse(data []byte, location string) ([]Image, error) {
	var head struct {
		Format string          `json:"format"`
		Images json.RawMessage `json:"images"`
	}
	if err := json.Unmarshal(data, &head); err != nil {
		return nil, fmt.Errorf("index is not JSON: %w", err)
	}
	switch {
	case head.Format == "products:1.0":
		return parseProducts(data, location)
	case head.Format != "":
		return nil, fmt.Errorf("index format %q is not products:1.0 (an index:1.0 document lists other documents: name a products file)", head.Format)
	case head.Images != nil:
		return parseFlat(data, location)
	}
	return nil, errors.New(`index is neither a SimpleStreams products:1.0 document nor a vmhost index ({"images": [...]})`)
}

// attrs are the SimpleStreams attributes vmhost reads. SimpleStreams lets
// a product's attributes apply to its versions and items unless they say
// otherwise.
type attrs struct {
	OS      string `json:"os"`
	Release string `json:"release"`
	Version string `json:"version"`
	Arch    string `json:"arch"`
}

func (a attrs) under(b attrs) attrs {
	pick := func(x, y string) string {
		if x != "" {
			return x
		}
		return y
	}
	return attrs{pick(a.OS, b.OS), pick(a.Release, b.Release), pick(a.Version, b.Version), pick(a.Arch, b.Arch)}
}

type ssItem struct {
	attrs
	Ftype  string `json:"ftype"`
	Path   string `json:"path"`
	SHA256 string `json:"sha256"`
	Size   int64  `json:"size"`
}

type ssVersion struct {
	attrs
	Items map[string]ssItem `json:"items"`
}

type ssProduct struct {
	attrs
	Versions map[string]ssVersion `json:"versions"`
}

func parseProducts(data []byte, location string) ([]Image, error) {
	var doc struct {
		Products map[string]ssProduct `json:"products"`
	}
	if err := json.Unmarshal(data, &doc); err != nil {
		return nil, fmt.Errorf("reading products:1.0 document: %w", err)
	}
	root := mirrorRoot(location)
	var out []Image
	for pname, p := range doc.Products {
		for vname, v := range p.Versions {
			item, ok := pickDisk(v.Items)
			if !ok {
				continue
			}
			fetch := joinRoot(root, item.Path)
			if fetch == "" {
				continue
			}
			a := item.attrs.under(v.attrs.under(p.attrs))
			version := a.Release
			if version == "" {
				version = a.Version
			}
			out = append(out, Image{
				ImageID:       pname + ":" + vname,
				ContentSHA256: strings.ToLower(item.SHA256),
				FetchURL:      fetch,
				Distro:        a.OS,
				Version:       version,
				Arch:          a.Arch,
				SizeBytes:     item.Size,
				Source:        Redact(location),
			})
		}
	}
	return out, nil
}

// pickDisk returns the version's qcow2 disk image item, if it has one with
// a digest and a path.
func pickDisk(items map[string]ssItem) (ssItem, bool) {
	for _, ft := range diskFtypes {
		names := make([]string, 0, len(items))
		for n := range items {
			names = append(names, n)
		}
		sort.Strings(names) // one choice, whatever the map order
		for _, n := range names {
			it := items[n]
			if it.Ftype == ft && validDigest(it.SHA256) && it.Path != "" && !strings.HasPrefix(it.Path, "/") {
				return it, true
			}
		}
	}
	return ssItem{}, false
}

func parseFlat(data []byte, location string) ([]Image, error) {
	var doc struct {
		Images []Image `json:"images"`
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	if err := dec.Decode(&doc); err != nil {
		return nil, fmt.Errorf("reading vmhost index: %w", err)
	}
	out := doc.Images[:0]
	for _, im := range doc.Images {
		if im.ImageID == "" || !validDigest(im.ContentSHA256) || !fetchable(im.FetchURL) {
			continue
		}
		im.ContentSHA256 = strings.ToLower(im.ContentSHA256)
		im.Source = Redact(location)
		out = append(out, im)
	}
	return out, nil
}

func validDigest(s string) bool {
	return len(s) == 64 && strings.Trim(strings.ToLower(s), "0123456789abcdef") == ""
}

func fetchable(s string) bool {
	u, err := url.Parse(s)
	return err == nil && (u.Scheme == "http" || u.Scheme == "https") && u.Host != ""
}

// mirrorRoot is the index URL without its trailing streams/v1/<file>
// (or, for an index elsewhere, without its file name), credentials, query
// and fragment: item URLs are shown in views, and the credentials of an
// index must not be. "" when location is not an http(s) URL (a file index
// has no URL its items could be fetched from).
func mirrorRoot(location string) string {
	u, err := url.Parse(location)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return ""
	}
	dir, _ := path.Split(u.Path)
	if d, ok := strings.CutSuffix(dir, "streams/v1/"); ok {
		dir = d
	}
	u.Path, u.RawPath = dir, ""
	u.User, u.RawQuery, u.ForceQuery, u.Fragment, u.RawFragment = nil, "", false, "", ""
	return u.String()
}

// joinRoot joins a SimpleStreams item path (relative: pickDisk refuses
// absolute ones) to the mirror root; "" when either cannot make a URL.
func joinRoot(root, p string) string {
	base, err := url.Parse(root)
	if root == "" || err != nil {
		return ""
	}
	ref, err := url.Parse(p)
	if err != nil || ref.Scheme != "" || ref.Host != "" {
		return ""
	}
	return base.ResolveReference(ref).String()
}

// Redact returns location without URL credentials and with any query
// replaced by REDACTED (tokens travel there too); a file path is returned
// as it is.
func Redact(location string) string {
	if strings.HasPrefix(location, "/") {
		return location
	}
	u, err := url.Parse(location)
	if err != nil {
		return "(unparsable URL)"
	}
	u.User = nil
	if u.RawQuery != "" || u.ForceQuery {
		u.RawQuery, u.ForceQuery = "REDACTED", false
	}
	u.Fragment, u.RawFragment = "", ""
	return u.String()
}
