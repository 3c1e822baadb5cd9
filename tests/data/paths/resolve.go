// What Go's net/http server routes a request target to: each argument is a raw target,
// read as a request by http.ReadRequest and served by a ServeMux with one "/" handler. Prints,
// per line: the decoded path the handler sees, "redirect <location>" where the mux sends the
// client to its clean path (the client asks again, and that request is what is served), or
// "400" where the server refuses the request.
package main

import (
	"bufio"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
)

func main() {
	mux := http.NewServeMux()
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprint(w, r.URL.Path)
	})
	for _, raw := range os.Args[1:] {
		req, err := http.ReadRequest(bufio.NewReader(strings.NewReader(
			"GET " + raw + " HTTP/1.1\r\nHost: origin.test\r\n\r\n")))
		if err != nil {
			fmt.Println("400")
			continue
		}
		rec := httptest.NewRecorder()
		mux.ServeHTTP(rec, req)
		switch rec.Code {
		case http.StatusOK:
			fmt.Println(show(rec.Body.String()))
		case http.StatusMovedPermanently:
			fmt.Println("redirect " + rec.Header().Get("Location"))
		default:
			fmt.Println(rec.Code)
		}
	}
}

func show(path string) string {
	var b strings.Builder
	for i := 0; i < len(path); i++ {
		c := path[i]
		if c <= ' ' || c > '~' || c == '%' {
			fmt.Fprintf(&b, "%%%02X", c)
		} else {
			b.WriteByte(c)
		}
	}
	return b.String()
}
