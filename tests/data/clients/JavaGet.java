// A Java program with no proxy setup of its own, as an agent's tool would be: HttpURLConnection
// for each URL, the JVM's proxy properties (which `leasegate run` sets in JAVA_TOOL_OPTIONS)
// deciding where it goes.
//
//   java JavaGet.java URL...
//
// Prints, per URL, "URL status N" and the refusal's code (x-leasegate-refusal) when there is
// one, then the body's first line; or "URL error EXCEPTION". Exits 0.
import java.io.BufferedReader;
import java.io.InputStream;
import java.io.InputStreamReader;
import java.net.HttpURLConnection;
import java.net.URL;

public class JavaGet {
    public static void main(String[] args) throws Exception {
        for (String target : args) {
            try {
                HttpURLConnection connection = (HttpURLConnection) new URL(target).openConnection();
                connection.setConnectTimeout(10000);
                connection.setReadTimeout(20000);
                int status = connection.getResponseCode();
                String code = connection.getHeaderField("x-leasegate-refusal");
                InputStream body = status < 400 ? connection.getInputStream() : connection.getErrorStream();
                String first = "";
                if (body != null) {
                    BufferedReader reader = new BufferedReader(new InputStreamReader(body, "UTF-8"));
                    String line = reader.readLine();
                    first = line == null ? "" : line;
                }
                System.out.println(target + " status " + status + (code == null ? "" : " " + code) + " " + first);
            } catch (Exception e) {
                System.out.println(target + " error " + e);
            }
        }
    }
}
