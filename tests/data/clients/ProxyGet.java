// A plain Java client for the clients tests: GET one https:// URL through the proxy the JVM is
// configured with (-Dhttps.proxyHost, -Dhttps.proxyPort), trusting one CA file, with Basic
// proxy credentials from an Authenticator when given. Run in single-file source mode:
//
//   java -Dhttps.proxyHost=H -Dhttps.proxyPort=P ProxyGet.java httpclient|urlconnection URL CA.pem [USER PASSWORD]
//
// Prints "status N" and the body, or the exception, and exits 0 for a 2xx answer, 1 otherwise.
import java.io.FileInputStream;
import java.io.InputStream;
import java.net.Authenticator;
import java.net.HttpURLConnection;
import java.net.PasswordAuthentication;
import java.net.ProxySelector;
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.nio.charset.StandardCharsets;
import java.security.KeyStore;
import java.security.cert.CertificateFactory;
import java.time.Duration;
import javax.net.ssl.HttpsURLConnection;
import javax.net.ssl.SSLContext;
import javax.net.ssl.TrustManagerFactory;

public class ProxyGet {
    public static void main(String[] args) throws Exception {
        String mode = args[0];
        URI uri = URI.create(args[1]);
        SSLContext tls = trusting(args[2]);
        Authenticator credentials = null;
        if (args.length == 5) {
            String user = args[3];
            char[] password = args[4].toCharArray();
            credentials = new Authenticator() {
                @Override
                protected PasswordAuthentication getPasswordAuthentication() {
                    if (getRequestorType() == RequestorType.PROXY) {
                        return new PasswordAuthentication(user, password);
                    }
                    return null;
                }
            };
        }
        try {
            int status;
            String body;
            if (mode.equals("httpclient")) {
                HttpClient.Builder builder = HttpClient.newBuilder()
                        .proxy(ProxySelector.getDefault())
                        .sslContext(tls)
                        .connectTimeout(Duration.ofSeconds(10));
                if (credentials != null) {
                    builder.authenticator(credentials);
                }
                HttpResponse<String> response = builder.build().send(
                        HttpRequest.newBuilder(uri).timeout(Duration.ofSeconds(20)).build(),
                        HttpResponse.BodyHandlers.ofString());
                status = response.statusCode();
                body = response.body() == null ? "" : response.body();
            } else {
                if (credentials != null) {
                    Authenticator.setDefault(credentials);
                }
                HttpsURLConnection connection = (HttpsURLConnection) uri.toURL().openConnection();
                connection.setSSLSocketFactory(tls.getSocketFactory());
                connection.setConnectTimeout(10_000);
                connection.setReadTimeout(20_000);
                status = connection.getResponseCode();
                InputStream in = status < 400 ? connection.getInputStream() : connection.getErrorStream();
                body = in == null ? "" : new String(in.readAllBytes(), StandardCharsets.UTF_8);
            }
            System.out.println("status " + status);
            System.out.print(body);
            System.exit(status / 100 == 2 ? 0 : 1);
        } catch (Exception e) {
            System.out.println(e);
            System.exit(1);
        }
    }

    /** A TLS context that trusts the certificate(s) in one PEM file, and nothing else. */
    static SSLContext trusting(String caFile) throws Exception {
        KeyStore store = KeyStore.getInstance(KeyStore.getDefaultType());
        store.load(null, null);
        try (InputStream in = new FileInputStream(caFile)) {
            store.setCertificateEntry("ca", CertificateFactory.getInstance("X.509").generateCertificate(in));
        }
        TrustManagerFactory trust = TrustManagerFactory.getInstance(TrustManagerFactory.getDefaultAlgorithm());
        trust.init(store);
        SSLContext context = SSLContext.getInstance("TLS");
        context.init(null, trust.getTrustManagers(), null);
        return context;
    }
}
