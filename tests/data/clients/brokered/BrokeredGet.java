// Java's HttpClient as an agent runs it through a terminated host: the proxy from the JVM's
// properties (-Dhttps.proxyHost, -Dhttps.proxyPort; Java ignores HTTPS_PROXY), given USER and
// PASSWORD with Basic credentials from an Authenticator
// (-Djdk.http.auth.tunneling.disabledSchemes= lets Basic through for tunnels), the CA from the
// default trust store (-Djavax.net.ssl.trustStore), the placeholder from GITHUB_TOKEN in its
// Authorization header. With an Authenticator, HttpClient drops an Authorization header it is
// given.
//
//   java ... BrokeredGet 1.1|2 URL [USER PASSWORD]
//
// Prints "status N HTTP/V", a refusal's code (x-leasegate-refusal: CODE) when there is one,
// and the body, or the exception; exits 0 for a 2xx answer, 1 otherwise.
import java.net.Authenticator;
import java.net.PasswordAuthentication;
import java.net.ProxySelector;
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.time.Duration;

public class BrokeredGet {
    public static void main(String[] args) {
        HttpClient.Version version =
                args[0].equals("2") ? HttpClient.Version.HTTP_2 : HttpClient.Version.HTTP_1_1;
        Authenticator credentials = new Authenticator() {
            @Override
            protected PasswordAuthentication getPasswordAuthentication() {
                if (getRequestorType() == RequestorType.PROXY) {
                    return new PasswordAuthentication(args[2], args[3].toCharArray());
                }
                return null;
            }
        };
        try {
            HttpClient.Builder builder = HttpClient.newBuilder()
                    .version(version)
                    .proxy(ProxySelector.getDefault())
                    .connectTimeout(Duration.ofSeconds(10));
            if (args.length == 4) {
                builder.authenticator(credentials);
            }
            HttpClient client = builder.build();
            HttpRequest request = HttpRequest.newBuilder(URI.create(args[1]))
                    .header("Authorization", "Bearer " + System.getenv("GITHUB_TOKEN"))
                    .timeout(Duration.ofSeconds(20))
                    .build();
            HttpResponse<String> response = client.send(request, HttpResponse.BodyHandlers.ofString());
            String answered = response.version() == HttpClient.Version.HTTP_2 ? "HTTP/2" : "HTTP/1.1";
            System.out.println("status " + response.statusCode() + " " + answered);
            response.headers().firstValue("x-leasegate-refusal")
                    .ifPresent(code -> System.out.println("x-leasegate-refusal: " + code));
            System.out.print(response.body());
            System.exit(response.statusCode() / 100 == 2 ? 0 : 1);
        } catch (Exception e) {
            System.out.println(e);
            System.exit(1);
        }
    }
}
